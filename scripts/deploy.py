"""Render the Kubernetes objects that serve a model: a Deployment and a Service.

    python scripts/deploy.py render conf/deploy/demo.yaml image=registry/llmfoundry:1 > serve.yaml
    python scripts/deploy.py render conf/deploy/demo.yaml --engine vllm model=s3://b/hf gpus=1
    kubectl apply -f serve.yaml

key=value arguments override the config's keys (replicas=3, resources.limits.memory=16Gi).
--engine vllm runs `vllm serve` on an exported transformers folder instead of scripts/serve.py.
The API key stays in the Kubernetes Secret named by api_key_secret; nothing here reads it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from llmfoundry.serving.deploy import ENGINES, load_spec, render, to_yaml
from llmfoundry.utils.cli import add_script_arguments, script_errors
from llmfoundry.utils.errors import UserError


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("render", help="print (or write) the manifest")
    r.add_argument("config", help="conf/deploy/<name>.yaml")
    r.add_argument("overrides", nargs="*", help="key=value overrides")
    r.add_argument("--engine", choices=ENGINES, help="override the config's engine")
    r.add_argument("-o", "--output", type=Path, help="write here instead of stdout")
    add_script_arguments(r, storage=False)
    # Overrides may come after --engine too: gather the positionals argparse left over.
    args, rest = p.parse_known_args(argv)
    unknown = [a for a in rest if a.startswith("-")]
    if unknown:
        p.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.overrides += rest
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with script_errors(args):
        return write(args)


def write(args: argparse.Namespace) -> int:
    bad = [o for o in args.overrides if "=" not in o]
    if bad:
        raise UserError(f"overrides are key=value, got {' '.join(bad)}")
    text = to_yaml(render(load_spec(args.config, args.overrides, args.engine)))
    if args.output is None:
        sys.stdout.write(text)
    else:
        args.output.write_text(text)
        print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

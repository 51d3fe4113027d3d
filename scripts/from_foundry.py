"""Translate an llm-foundry train YAML into our config, once, for good.

    python scripts/from_foundry.py their.yaml [key=value ...]        # print the config it becomes
    python scripts/from_foundry.py their.yaml --out conf/experiment/mine.yaml
    python scripts/train.py +experiment=mine                          # then run it as ours

key=value overrides are in llm-foundry's schema (variables.data_local=DIR, model.n_layers=2),
applied before the translation as llm-foundry applies them. The file is a conf/experiment file
(`# @package _global_`): the group choices and every value the YAML sets, so
`train.py +experiment=NAME` composes the same config as `train.py their.yaml`. Keys with no
counterpart needed here are listed at its top; inputs to make first (an imported transformers
folder, instruction rows) are listed with their commands. A key we cannot honour is refused in
one line naming it and what to use instead.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from llmfoundry.config.foundry import load, translate
from llmfoundry.utils.cli import add_script_arguments, script_errors
from llmfoundry.utils.errors import OutputExists


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("yaml", help="an llm-foundry train YAML")
    parser.add_argument("overrides", nargs="*", help="key=value in llm-foundry's schema")
    parser.add_argument("--out", help="write the experiment file here (conf/experiment/NAME.yaml)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    parser.add_argument(
        "--nproc",
        type=int,
        default=1,
        help="processes the run will have (torchrun's world size; default 1: as llm-foundry, "
        "one process trains without FSDP); fsdp_config's strategy is chosen for it",
    )
    parser.add_argument(
        "--nproc-per-node", type=int, help="processes per node (default --nproc: one node)"
    )
    add_script_arguments(parser, storage=False)
    args = parser.parse_args(argv)
    with script_errors(args):
        env = {**os.environ, "WORLD_SIZE": str(args.nproc)}
        env["LOCAL_WORLD_SIZE"] = str(args.nproc_per_node or args.nproc)
        native = translate(load(args.yaml, args.overrides), env)
        text = native.experiment_yaml(args.yaml)
        if not args.out:
            sys.stdout.write(text)
            return 0
        out = Path(args.out)
        if out.exists() and not args.overwrite:
            raise OutputExists(f"{out} exists; pass --overwrite to replace it")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text, encoding="utf-8")
        print(f"wrote {out}\nrun it: python scripts/train.py +experiment={out.stem}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

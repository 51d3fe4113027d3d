"""Render or submit a job file (conf/job/*.yaml, or an MCLI run file) here, to Slurm or Kubernetes.

    python scripts/launch.py render slurm conf/job/tiny.yaml compute.gpus=24   # writes .launch/<name>/
    python scripts/launch.py submit local conf/job/tiny.yaml --gpus 0 compute.procs_per_node=2
    python scripts/launch.py submit local conf/job/tiny.yaml --detach   # runs.py logs|stop NAME
    python scripts/launch.py submit kubernetes conf/job/tiny.yaml --train optimizer.lr=1e-3

Any job field can be overridden as key=value; --gpus N is compute.gpus=N; --train adds training
overrides. The training overrides are checked against conf/ before anything is written. The
backends: llmfoundry/launch/backends.py. An MCLI run file (``mcli run -f`` YAML) is mapped onto a
job first (llmfoundry/launch/mcli.py); the overrides then apply to that job.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from llmfoundry.config.preflight import check
from llmfoundry.launch import load_job
from llmfoundry.launch.backends import BACKENDS, submit_local
from llmfoundry.launch.command import train_overrides
from llmfoundry.utils.cli import add_script_arguments, script_errors

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=["render", "submit"])
    parser.add_argument("backend", choices=sorted(BACKENDS))
    parser.add_argument("job", help="the job file, e.g. conf/job/tiny.yaml")
    parser.add_argument("overrides", nargs="*", help="job fields as key=value")
    parser.add_argument("--gpus", type=int, help="GPUs in total (compute.gpus)")
    parser.add_argument(
        "--train", action="append", default=[], help="a training override (repeatable)"
    )
    parser.add_argument("--out", type=Path, help="folder for the rendered file")
    parser.add_argument(
        "--detach",
        action="store_true",
        help="local: run in the background, output in the run folder's launch.log (Slurm and "
        "Kubernetes submissions always return at once)",
    )
    add_script_arguments(parser, storage=False)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    with script_errors(args, prefix="Job error"):
        return launch(args)


def launch(args: argparse.Namespace) -> int:
    overrides = list(args.overrides)
    if args.gpus is not None:
        overrides.append(f"compute.gpus={args.gpus}")
    render, submit = BACKENDS[args.backend]
    job = load_job(args.job, overrides, train=args.train, backend=args.backend)
    rendered = render(job, ROOT)
    # Hydra-only keys are checked by Hydra itself when the run starts; an llm-foundry config
    # (an MCLI run file's parameters) is checked by train.py, which reads it.
    if job.foundry_config is None:
        check(
            ROOT / "conf",
            [o for o in train_overrides(job, rendered.layout) if not o.startswith("hydra.")],
        )
    out = args.out or ROOT / ".launch" / job.name
    out.mkdir(parents=True, exist_ok=True)
    path = out / rendered.filename
    path.write_text(rendered.text)
    layout = rendered.layout
    units = "GPUs" if layout.gpus_per_node else "CPU processes"
    print(f"{args.backend}: {layout.nodes} node(s) x {layout.procs_per_node} {units} -> {path}")
    if args.action == "render":
        return 0
    if args.backend == "local":
        return submit_local(path, job, ROOT, detach=args.detach)
    return submit(path, job, ROOT)


if __name__ == "__main__":
    # As scripts/train.py: `model._target_=my_pkg.build_model` is found in the folder the job is
    # launched from (the code folder the run starts in), for the config check.
    sys.path.append(os.getcwd())
    sys.exit(main())

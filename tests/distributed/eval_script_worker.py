"""The ranks of tests/eval/test_eval_on_mesh.py (spawned children import them by module path):
scripts/eval.py's `main` in each process with the environment torchrun gives it, once per mesh
in a row (a fresh process group each), each rank's stdout kept in a file of its own."""

from __future__ import annotations

import contextlib
import runpy
from pathlib import Path

from .spawn import join_env

EVAL = Path(__file__).resolve().parents[2] / "scripts" / "eval.py"


def output(out: str, mesh: str, rank: int) -> Path:
    """Where rank `rank` of the run at `mesh` wrote its stdout."""
    return Path(out, f"{mesh}-rank{rank}.out")


def rank_main(
    rank: int, world: int, ports: list[int], runs: dict[str, list[str]], out: str
) -> None:
    """`scripts/eval.py <runs[mesh]>` for each mesh, on `ports` in turn."""
    for port, (mesh, argv) in zip(ports, runs.items(), strict=True):
        join_env(rank, world, port)
        main = runpy.run_path(str(EVAL), run_name="eval")["main"]
        with output(out, mesh, rank).open("w") as stdout, contextlib.redirect_stdout(stdout):
            assert main(argv) == 0

"""Checkpoints written by an older main keep resuming: an MPT and a Llama run (full checkpoints)
and a two-process FSDP run (sharded), each saved at batch 2 by commit 55b5ace (before issue 22's
reshape moved the code; `old_main/make.py` wrote them), resume with today's `scripts/train.py`
and take batches 3 and 4 with the samples and losses of the old code's straight run.

The losses agree to 1e-5 rather than bit for bit: the files may be resumed on another CPU than
the one that wrote them, whose float sums differ in the last bits; the sharded one also resumes
on one process instead of two.
"""

import json
import math
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from .old_main.make import ROOT, SCENARIOS, train_command

pytestmark = pytest.mark.slow  # runs scripts/train.py in subprocesses

OLD = Path(__file__).resolve().parent / "old_main"
TIMEOUT = 300


def test_checkpoints_of_the_old_main_resume_as_its_straight_runs(tmp_path):
    runs = {}
    for name in SCENARIOS:
        work = tmp_path / name
        shutil.copytree(OLD / name / "ckpt", work / "ckpt")
        command = train_command(OLD / "mds", work, name, "max_duration=4ba", "autoresume=true")
        command = [arg for arg in command if arg != "strategy=fsdp"]  # one process resumes it
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        runs[name] = subprocess.Popen(
            command, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
    for name, process in runs.items():
        out, _ = process.communicate(timeout=TIMEOUT)
        assert process.returncode == 0, f"{name}:\n{out}"
        resumed = _by_batch(tmp_path / name / "steps.jsonl")
        straight = _by_batch(OLD / name / "steps.jsonl")
        assert sorted(resumed) == [3, 4], (name, out)
        for batch, (loss, ids) in resumed.items():
            old_loss, old_ids = straight[batch]
            assert ids == old_ids, (name, batch)
            assert math.isclose(loss, old_loss, rel_tol=1e-5), (name, batch, loss, old_loss)


def _by_batch(path: Path) -> dict[int, tuple[float, list[int]]]:
    """{batch: (loss, its sample ids sorted)}: each rank writes a line with its part of the batch."""
    steps: dict[int, tuple[float, list[int]]] = {}
    for line in path.read_text().splitlines():
        step = json.loads(line)
        loss, ids = steps.get(step["batch"], (float.fromhex(step["loss"]), []))
        steps[step["batch"]] = (loss, sorted(ids + step["ids"]))
    return steps

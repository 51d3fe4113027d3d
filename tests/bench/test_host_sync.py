"""bench/host_sync.py: its counts on a short run (the trainer's own guard on them is
tests/trainer/test_host_sync.py)."""

import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "host_sync.py"


def test_a_short_run_reads_the_device_only_at_intervals():
    bench = runpy.run_path(str(SCRIPT))
    # The run-status heartbeat reads on a clock, so how many depends on the machine's speed:
    # none here (a loaded 2-core machine took one more with the default 10 s: 0.55 per step).
    result = bench["run"](steps=22, warmup=2, status_interval_s=3600)
    # 20 timed steps: the console, NaN detector and JSONL read at batches 10 and 20, and the
    # fit's end reads the loss once more for each of its lines: far below the old two a step.
    assert 0 < result["reads_per_step"] <= 0.5, result
    assert result["all_reduces_per_step"] == 1.0  # the loss's; the counts need none alone
    assert result["cpu_ms_per_step"] > 0


def test_fsdp_auto_microbatching_agrees_per_step_not_per_block_once_the_size_settles():
    """Two FSDP ranks (gloo) with device_train_microbatch_size=auto, counted from batch 5 (the
    size settled after 2): the step's own all-reduces (counts, the out-of-memory flag, the
    loss), where guarding every block's forward and backward added 3 per block and unit (9
    here: two blocks and the root) and as many host reads."""
    command = [sys.executable, str(SCRIPT), "--ranks", "2", "--strategy", "fsdp", "--microbatch",
               "auto", "--steps", "12", "--warmup", "4", "--repeats", "1"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(SCRIPT.parents[1]), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    counts = re.search(r"([\d.]+) host reads/step, ([\d.]+) all-reduces/step", out.stdout)
    reads, all_reduces = map(float, counts.groups())
    assert all_reduces == 3.0, out.stdout
    # The flag and the counts are read every step, besides the log lines at batch 10 and the
    # fit's end (and the run-status heartbeat on a slow machine): 2.9 here, 11.5 guarded.
    assert 2.0 <= reads < 4.0, out.stdout

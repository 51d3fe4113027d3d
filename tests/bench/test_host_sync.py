"""bench/host_sync.py: its counts on a short run (the trainer's own guard on them is
tests/trainer/test_host_sync.py)."""

import runpy
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "host_sync.py"


def test_a_short_run_reads_the_device_only_at_intervals():
    bench = runpy.run_path(str(SCRIPT))
    result = bench["run"](steps=22, warmup=2)
    # 20 timed steps: the console, NaN detector and JSONL read at batches 10 and 20, and the
    # last batch's progress line once more: far below the old two reads per step.
    assert 0 < result["reads_per_step"] <= 0.5, result
    assert result["all_reduces_per_step"] == 1.0  # the loss's; the counts need none alone
    assert result["cpu_ms_per_step"] > 0

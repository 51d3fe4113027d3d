"""bench/host_sync.py: its counts on a short run (the trainer's own guard on them is
tests/trainer/test_host_sync.py)."""

import runpy
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

"""bench/context_parallel.py: its report against cp=1 (ratios, the issue's two targets) on
rows made here, and one tiny cp=2 job (two gloo processes) measured for real."""

import argparse
import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "context_parallel.py"
MIB = 2**20


def test_the_report_compares_each_cp_with_cp_1_of_the_same_run():
    bench = runpy.run_path(str(SCRIPT))

    def row(mib):
        return {"activation_bytes": mib * MIB, "step_s": 1.0, "state_bytes": 8 * MIB}

    # cp=1 grows 100 MiB per 1024 tokens; cp=2 holds about half; cp=4 misses its target.
    rows = {
        1: {1024: row(100), 2048: row(200), 4096: row(400)},
        2: {1024: row(50), 2048: row(100), 4096: row(240)},
        4: {1024: row(40), 2048: row(70), 4096: row(130)},
    }
    args = argparse.Namespace(model="m", precision="fp32", batch=1, device="cpu",
                              activation_checkpointing="none",
                              lengths=[1024, 2048, 4096])  # fmt: skip
    out = bench["report"](rows, args)
    assert re.search(r"^ +4096 \| cp=1: +400\.0 .* \| cp=2: +240\.0 +1\.00 +1\.67 \|", out, re.M)
    assert "target cp=2 at 4096: 240.0 MiB <= 1.25 x 400.0 / 2 = 250.0 MiB: met" in out
    assert "target cp=4 at 4096: 130.0 MiB <= 1.25 x 400.0 / 4 = 125.0 MiB: MISSED" in out
    # cp=1's memory at 1024 (100 MiB) is cp=2's at 2048 and, interpolated, cp=4's at 3072.
    assert "cp=2: 2048 (2.0x)" in out and "cp=4: 3072 (3.0x)" in out


@pytest.mark.slow
@pytest.mark.skipif(
    not os.access("/proc/self/clear_refs", os.W_OK), reason="needs Linux /proc/self/clear_refs"
)
def test_a_tiny_cp_2_job_measures_memory_and_time():
    command = [sys.executable, str(SCRIPT), "--cps", "2", "--lengths", "64", "--layers", "1",
               "--steps", "1"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(SCRIPT.parents[1])}
    out = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    measured = re.search(r"^ +64 \| cp=2: +([\d.]+) +([\d.]+) ", out.stdout, re.M)
    assert measured and min(map(float, measured.groups())) > 0, out.stdout
    assert "targets: not checked (no cp=1 rows)" in out.stdout

"""bench/context_parallel.py at tiny sizes: both cp jobs run (torchrun, gloo), every row is
measured, and the report compares them with cp=1 of the same run."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "context_parallel.py"


@pytest.mark.slow
@pytest.mark.skipif(
    not os.access("/proc/self/clear_refs", os.W_OK), reason="needs Linux /proc/self/clear_refs"
)
def test_the_bench_measures_cp_1_and_2_and_reports_the_ratios():
    command = [sys.executable, str(SCRIPT), "--cps", "1", "2", "--lengths", "64", "256",
               "--layers", "1", "--steps", "2"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(SCRIPT.parents[1]), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {
        int(m["seq"]): [float(x) for x in m.groups()[1:]]
        for m in re.finditer(
            r"^ +(?P<seq>\d+) \| cp=1: +([\d.]+) +([\d.]+) +[\d.]+ \| cp=2: +([\d.]+) +([\d.]+) "
            r"+([\d.]+)$",
            out.stdout,
            re.M,
        )
    }
    assert sorted(rows) == [64, 256], out.stdout
    for one_mib, one_s, two_mib, two_s, ratio in rows.values():
        assert min(one_mib, one_s, two_mib, two_s) > 0, out.stdout
        assert ratio == pytest.approx(one_mib / two_mib, abs=0.01)
    assert re.search(r"^target cp=2 at 256: .* (met|MISSED)$", out.stdout, re.M), out.stdout
    assert "longest length in cp=1's memory at 256" in out.stdout

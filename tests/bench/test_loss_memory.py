"""bench/loss_memory.py: argument checks, and its CPU rows at a tiny shape."""

import runpy
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "loss_memory.py"


@pytest.fixture(scope="module")
def bench():
    return runpy.run_path(str(SCRIPT))


def test_bad_arguments_are_refused(bench, capsys):
    with pytest.raises(SystemExit):
        bench["main"](["--vocab", "0"])
    assert "must be positive" in capsys.readouterr().err


def test_cpu_rows_time_ours_against_the_baseline(bench):
    rows = bench["main"](["--batch", "2", "--seq-len", "16", "--vocab", "64", "--repeats", "1"])
    assert [row["row"] for row in rows] == ["loss", "eval"]
    for row in rows:
        assert row["shape"] == [2, 16, 64] and row["ours_ms"] >= 0 and "ratio_ms" in row

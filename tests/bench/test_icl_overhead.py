"""bench/icl_overhead.py: a small pass against small steps prints both times and their ratio."""

import re
import runpy
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "icl_overhead.py"
TINY = ["model.d_model=32", "model.n_heads=2", "model.n_layers=1", "model.vocab_size=64",
        "model.max_seq_len=32", "global_train_batch_size=2"]  # fmt: skip


@pytest.fixture(scope="module")
def bench():
    return runpy.run_path(str(SCRIPT))


def test_the_pass_and_the_steps_are_timed_in_the_same_run(bench, capsys):
    argv = [*TINY, "--questions", "6", "--rounds", "1", "--context", "4", "8", "--choice", "1",
            "3", "--batch-size", "5"]  # fmt: skip
    assert bench["main"](argv) == 0
    out = capsys.readouterr().out
    assert "training batch 2 x 32" in out
    assert re.search(r"icl pass: [\d.]+ s \(6 questions, 24 rows, [\d,]+ tokens, batch 5\)", out)
    assert re.search(r"3 training steps: [\d.]+ s \(192 tokens\)", out)
    assert re.search(r"pass / 3 steps: [\d.]+ \(target <= 1\)", out)


@pytest.mark.parametrize(
    ("argv", "message"),
    [(["--choices", "1"], "--choices at least 2"), (["--context", "9", "3"], "MIN MAX")],
)
def test_bad_arguments_are_refused(bench, capsys, argv, message):
    with pytest.raises(SystemExit):
        bench["parse_args"](argv)
    assert message in capsys.readouterr().err

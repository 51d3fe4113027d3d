"""bench/passkey.py: argument checks, sides that differ only in attention, a tiny run's table."""

import json
import runpy
from pathlib import Path

import pytest
from omegaconf import OmegaConf

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "passkey.py"
TINY = ["--seq-len", "24", "--window", "8", "--d-model", "16", "--n-heads", "2",
        "--n-layers", "1", "--steps", "2", "--batch", "2", "--val-rows", "12"]  # fmt: skip


@pytest.fixture(scope="module")
def bench():
    return runpy.run_path(str(SCRIPT))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--seq-len", "64", "--window", "64"], "must be shorter than --seq-len 64"),
        (["--steps", "0"], "must be positive"),
        (["--seq-len", "6", "--window", "2"], "use seq_len >= 8"),
    ],
)
def test_bad_arguments_are_refused(bench, capsys, argv, message):
    with pytest.raises(SystemExit):
        bench["parse_args"](argv)
    assert message in capsys.readouterr().err


def test_the_sides_differ_only_in_their_attention(bench, tmp_path):
    args = bench["parse_args"](TINY)
    task = bench["PasskeyTask"](args.seq_len, args.n_digits, args.n_filler)
    cfgs = {
        side: OmegaConf.to_container(
            bench["compose_config"](
                bench["CONF"], bench["side_overrides"](side, args, task, tmp_path)
            )
        )
        for side in bench["SIDES"]
    }
    infini, plain = cfgs["infini"], cfgs["plain"]
    assert infini["model"].pop("infini")["segment_len"] == 8
    assert (
        plain["model"].pop("sliding_window") == 8 and infini["model"].pop("sliding_window") is None
    )
    for cfg in cfgs.values():  # each side's own run and checkpoints
        del cfg["run_name"], cfg["save_folder"]
    assert infini == plain
    assert plain["model"]["max_seq_len"] == 24 and plain["model"]["vocab_size"] == len(task.vocab)


def test_a_tiny_run_scores_both_sides_at_every_depth(bench, tmp_path, capsys):
    out = tmp_path / "passkey.json"
    assert bench["main"]([*TINY, "--json", str(out), "--keep", str(tmp_path / "run")]) == 0
    result = json.loads(out.read_text())
    for side in bench["SIDES"]:
        assert result[side]["window"] == 8
        assert sum(d["rows"] for d in result[side]["depths"].values()) == 12
        assert (tmp_path / "run" / side / "checkpoints" / "latest").exists()
    assert result["infini"]["depths"].keys() == result["plain"]["depths"].keys()
    lines = capsys.readouterr().out.splitlines()
    header = lines.index("| depth (windows back) | key distance (tokens) | rows | infini | plain |")
    assert lines[-1] == "| chance | | | 0.010 | 0.010 |"
    assert lines[-2].startswith("| >= 1 (beyond one window) | >= 8 |")
    assert len(lines) - header == 2 + len(result["infini"]["depths"]) + 2


def test_a_keep_folder_with_files_is_refused(bench, tmp_path, capsys):
    (tmp_path / "old.txt").write_text("x")
    with pytest.raises(SystemExit) as exit_info:
        bench["main"]([*TINY, "--keep", str(tmp_path)])
    assert exit_info.value.code == 2 and "is not empty" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["old.txt"]


def test_the_table_sums_beyond_the_window_and_beyond_the_plain_model_s_reach(bench):
    def side(correct):  # depth -> correct of 10 rows
        return {"window": 4, "depths": {str(d): {"correct": c, "rows": 10, "accuracy": c / 10}
                                        for d, c in enumerate(correct)}}  # fmt: skip

    results = {"infini": side([9, 8, 7, 6]), "plain": side([10, 5, 1, 0])}
    task = bench["PasskeyTask"](seq_len=16, n_digits=1)
    # Two layers of a 4-token window reach 6 tokens back: depth 1 (4-7) in part, 2 on never.
    lines = bench["table"](results, task, n_layers=2)
    assert lines[2:] == [
        "| 0 | 0-3 | 10 | 0.900 | 1.000 |",
        "| 1 | 4-7 | 10 | 0.800 | 0.500 |",
        "| 2 | 8-11 | 10 | 0.700 | 0.100 |",
        "| 3 | 12-15 | 10 | 0.600 | 0.000 |",
        "| >= 1 (beyond one window) | >= 4 | 30 | **0.700** (21/30) | **0.200** (6/30) |",
        "| >= 2 (beyond the plain model's reach) | >= 8 | 20 | **0.650** (13/20) | **0.050** (1/20) |",
        "| chance | | | 0.100 | 0.100 |",
    ]
    # One layer reaches only inside the window: the two sums would be the same rows.
    assert not any("reach" in line for line in bench["table"](results, task, n_layers=1))

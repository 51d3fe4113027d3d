import json
import subprocess
import sys
from pathlib import Path

import pytest

from llmfoundry.callbacks import LRMonitor, SpeedMonitor
from llmfoundry.loggers import JSONLLogger
from llmfoundry.loggers.plot import read_metrics
from tests.callbacks.conftest import make_trainer
from tests.trainer.conftest import token_batches

pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import plot as plot_script  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def train_run(folder, lr):
    make_trainer(
        folder,
        n_batches=4,
        lr=lr,
        eval_dataloaders={"val": token_batches(1, 4, seed=1)},
        eval_interval="2ba",
        callbacks=[LRMonitor(), SpeedMonitor(peak_flops=1e11)],
        loggers=[JSONLLogger()],
    ).fit()
    return folder


def test_plots_of_two_runs_are_pngs(tmp_path, capsys):
    runs = [train_run(tmp_path / "slow", 0.01), train_run(tmp_path / "fast", 0.1)]
    capsys.readouterr()
    written = plot_script.main([str(r) for r in runs] + ["--out", str(tmp_path / "plots")])
    assert sorted(p.name for p in written) == ["loss.png", "lr.png", "throughput.png"]
    for path in written:
        data = path.read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5000, path
    assert capsys.readouterr().out.split() == [str(p) for p in written]


def test_default_output_folder_and_labels(tmp_path):
    run = train_run(tmp_path / "run", 0.1)
    written = plot_script.main([str(run / "metrics.jsonl"), "--labels", "baseline"])
    assert {p.parent for p in written} == {run / "plots"}


def test_figures_without_metrics_are_skipped(tmp_path):
    # Only the trainer's loss: no lr monitor, no speed monitor.
    make_trainer(tmp_path, n_batches=2, loggers=[JSONLLogger()]).fit()
    written = plot_script.main([str(tmp_path), "--out", str(tmp_path / "p")])
    assert [p.name for p in written] == ["loss.png"]


def test_help_and_errors_from_the_command_line(tmp_path):
    script = ROOT / "scripts" / "plot.py"
    help_text = subprocess.run(
        [sys.executable, script, "--help"], capture_output=True, text=True, check=True
    ).stdout
    assert "loss.png" in help_text and "--labels" in help_text
    missing = subprocess.run(
        [sys.executable, script, str(tmp_path / "nope")], capture_output=True, text=True
    )
    assert missing.returncode == 2
    assert "no metrics file" in missing.stderr and "jsonl" in missing.stderr
    assert "Traceback" not in missing.stderr


def test_reader_keeps_the_last_value_of_a_step_and_skips_a_torn_last_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [
        {"time": 0, "hyperparameters": {"lr": 1}},
        {"step": 1, "time": 0, "metrics": {"loss/train": 5.0}},
        {"step": 2, "time": 0, "metrics": {"loss/train": 4.0}},
        # resumed from the checkpoint at step 1: step 2 is trained and logged again
        {"step": 2, "time": 0, "metrics": {"loss/train": 3.9, "odd": None}},
        {"step": 3, "time": 0, "metrics": {"loss/train": 3.5}},
    ]
    path.write_text("\n".join(json.dumps(line) for line in lines) + '\n{"step": 4, "ti')
    assert read_metrics(path) == {"loss/train": ([1, 2, 3], [5.0, 3.9, 3.5])}
    path.write_text(
        '{"step": 1, "metrics": {"a": 1}}\nnot json\n{"step": 2, "metrics": {"a": 1}}\n'
    )
    with pytest.raises(ValueError, match="metrics.jsonl:2: not a JSON line"):
        read_metrics(path)


def test_nothing_to_plot_is_an_error(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "time": 0, "metrics": {"other": 1.0}}\n')
    with pytest.raises(SystemExit):
        plot_script.main([str(tmp_path)])


def test_throughput_from_zero_and_identical_lr_groups_drawn_once(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    lines = [
        {"step": 1, "metrics": {"lr/group0": 0.1, "lr/group1": 0.1, "lr/group2": 0.05}},
        {"step": 2, "metrics": {"lr/group0": 0.2, "lr/group1": 0.2, "lr/group2": 0.1}},
        {"step": 1, "metrics": {"throughput/tokens_per_sec": 1000.0}},
        {"step": 2, "metrics": {"throughput/tokens_per_sec": 1010.0}},
    ]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(line) + "\n" for line in lines))
    drawn = {}
    save = Figure.savefig

    def record(fig, path, **kwargs):
        ax = fig.axes[0]
        drawn[Path(path).stem] = (ax.get_ylim(), [line.get_label() for line in ax.get_lines()])
        return save(fig, path, **kwargs)

    monkeypatch.setattr(Figure, "savefig", record)
    plot_script.main([str(metrics), "--labels", "run", "--out", str(tmp_path / "plots")])
    assert drawn["throughput"][0][0] == 0
    assert drawn["lr"][1] == ["run group0, group1", "run group2"]

"""End to end on CPU: Hydra sweeps (grid and Optuna) give every trial its own folder and name,
and sweep_report.py tabulates and plots them."""

import json

import pytest
from omegaconf import OmegaConf

from tests.checkpoint.helpers import write_mds
from tests.launch.test_local import ROOT, TINY, load_script, run


@pytest.fixture(scope="module")
def mds(tmp_path_factory):
    return write_mds(tmp_path_factory.mktemp("mds"), {"train": 32, "val": 8})


@pytest.mark.slow
def test_grid_sweep_gives_each_run_its_folder_and_name(tmp_path, mds):
    run(
        [
            str(ROOT / "scripts/train.py"),
            "-m",
            "optimizer.lr=1e-3,3e-3",
            "model.n_layers=1,2",
            f"data.remote={mds}",
            *TINY[:4],
            *TINY[5:],
            "max_duration=2ba",
            "eval_interval=2ba",
            "callbacks=[run_status]",
            "loggers=[jsonl]",
        ],
        cwd=tmp_path,
    )
    (sweep,) = (tmp_path / "outputs").glob("sweep-*")
    names = set()
    for number in range(4):
        folder = sweep / str(number)
        status = json.loads((folder / "status.json").read_text())
        assert status["status"] == "finished"
        names.add(status["run_name"])
        assert status["save_folder"] == str(folder / "checkpoints")
        assert (folder / "checkpoints" / "latest").is_file()
    assert names == {f"{sweep.name}/{n}" for n in range(4)}


@pytest.mark.slow
def test_optuna_sweep_of_three_trials_and_its_report(tmp_path, mds, capsys):
    pytest.importorskip(
        "hydra_plugins.hydra_optuna_sweeper", reason="pip install 'llmfoundry[sweep]'"
    )
    run(
        [
            str(ROOT / "scripts/train.py"),
            "-m",
            "+sweep=lr",
            "hydra.sweeper.n_trials=3",
            f"data.remote={mds}",
            *TINY,
            "callbacks=[speed_monitor,run_status]",
            "loggers=[jsonl]",
        ],
        cwd=tmp_path,
    )
    (sweep,) = (tmp_path / "outputs").glob("sweep-*")
    best = OmegaConf.load(sweep / "optimization_results.yaml").best_value
    assert load_script("sweep_report").main([str(sweep)]) == 0
    out = capsys.readouterr().out
    print(out)  # the table, for the record (pytest -s)
    lines = out.splitlines()
    assert lines[0].split() == ["TRIAL", "STATUS", "FINAL", "LOSS", "TOKENS/S", "OVERRIDES"]
    rows = [line.split() for line in lines[1:4]]
    assert [row[0] for row in sorted(rows)] == [f"{sweep.name}/{n}" for n in range(3)]
    assert all(row[1] == "finished" and row[4].startswith("optimizer.lr=") for row in rows)
    # Sorted by final loss; the best is what the sweeper minimised (scripts/train.py's return).
    assert float(rows[0][2]) == pytest.approx(best, abs=1e-4)
    assert [float(r[2]) for r in rows] == sorted(float(r[2]) for r in rows)
    assert (sweep / "plots" / "loss.png").stat().st_size > 0

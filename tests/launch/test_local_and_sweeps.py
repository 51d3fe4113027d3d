"""End to end on CPU: the local backend trains with 2 processes; Hydra sweeps (grid and Optuna)
give every trial its own folder and name, and sweep_report.py tabulates and plots them."""

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from llmfoundry.launch.command import RESUME_EXIT
from tests.checkpoint.helpers import SEQ_LEN, VOCAB, write_mds

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 240
TINY = [
    f"model.vocab_size={VOCAB}",
    f"model.max_seq_len={SEQ_LEN}",
    "model.d_model=64",
    "model.n_heads=2",
    "model.n_layers=2",
    "global_train_batch_size=4",
    "max_duration=4ba",
    "eval_interval=2ba",
    "eval_subset_num_batches=2",
    "scheduler.t_warmup=1ba",
]


@pytest.fixture(scope="module")
def mds(tmp_path_factory):
    return write_mds(tmp_path_factory.mktemp("mds"), {"train": 32, "val": 8})


def run(args, cwd):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def load_script(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_local_backend_trains_with_two_processes(tmp_path, mds, capsys):
    outputs = tmp_path / "outputs"
    train = [
        f"--train={o}"
        for o in [f"data.remote={mds}", *TINY, "callbacks=[]", "loggers=[console,jsonl]"]
    ]
    result = run(
        [
            str(ROOT / "scripts/launch.py"),
            "submit",
            "local",
            str(ROOT / "conf/job/tiny.yaml"),
            "name=two-procs",
            f"outputs={outputs}",
            "--out",
            str(tmp_path / "rendered"),
            *train,
        ],
        cwd=tmp_path,
    )
    assert "local: 1 node(s) x 2 CPU processes" in result.stdout
    folder = outputs / "two-procs"
    status = json.loads((folder / "status.json").read_text())
    assert (status["status"], status["step"], status["world_size"]) == ("finished", 4, 2)
    assert (folder / "checkpoints" / "latest").read_text().strip() == "ep0-ba4"
    assert "eval/val/loss: first" in (folder / "launch.log").read_text()
    assert load_script("runs").main([str(outputs)]) == 0
    row = next(
        line for line in capsys.readouterr().out.splitlines() if line.startswith("two-procs")
    )
    assert row.split()[1:3] == ["finished", "4/4"]


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


@pytest.mark.slow
def test_local_ctrl_c_checkpoints_and_the_same_command_resumes(tmp_path, mds):
    outputs = tmp_path / "outputs"
    train = [
        f"data.remote={mds}",
        *TINY,
        "max_duration=80ba",
        "eval_interval=40ba",
        "callbacks=[]",
        "loggers=[console]",
        "++callbacks.run_status.interval_s=0.2",
    ]
    command = [
        sys.executable,
        str(ROOT / "scripts/launch.py"),
        "submit",
        "local",
        str(ROOT / "conf/job/tiny.yaml"),
        "name=ctrl-c",
        f"outputs={outputs}",
        "--out",
        str(tmp_path / "rendered"),
        *(f"--train={o}" for o in train),
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    status_file = outputs / "ctrl-c" / "status.json"
    # Its own process group, as a terminal's: Ctrl-C reaches the launcher, torchrun and trainers.
    process = subprocess.Popen(
        command,
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + TIMEOUT
        while not (status_file.is_file() and json.loads(status_file.read_text())["step"] >= 10):
            assert time.monotonic() < deadline and process.poll() is None, "no progress"
            time.sleep(0.2)
        os.killpg(process.pid, signal.SIGINT)
        assert process.wait(TIMEOUT) == RESUME_EXIT
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(30)
    stopped = json.loads(status_file.read_text())
    assert stopped["status"] == "preempted" and 10 <= stopped["step"] < 80
    run(command[1:], cwd=tmp_path)
    assert json.loads(status_file.read_text())["status"] == "finished"
    assert (
        f"loaded checkpoint {outputs}/ctrl-c/checkpoints/ep"
        in (outputs / "ctrl-c" / "launch.log").read_text()
    )


@pytest.mark.slow
def test_a_detached_local_run_is_stopped_by_runs_stop(tmp_path, mds):
    """`submit local --detach` returns while the run trains; `runs.py stop NAME --yes` makes it
    checkpoint and stop (preempted, resumable), as `mcli stop run` does."""
    outputs = tmp_path / "outputs"
    train = [
        f"data.remote={mds}",
        *TINY,
        "max_duration=100000ba",  # stopped long before: a quiet machine trains 400 in seconds
        "eval_interval=100000ba",
        "callbacks=[]",
        "loggers=[console]",
        "++callbacks.run_status.interval_s=0.2",
    ]
    submit = ["submit", "local", str(ROOT / "conf/job/tiny.yaml"), "name=bg", f"outputs={outputs}"]
    submit += ["--out", str(tmp_path / "rendered"), "--detach", *(f"--train={o}" for o in train)]
    result = run([str(ROOT / "scripts/launch.py"), *submit], cwd=tmp_path)
    assert f"python scripts/runs.py stop bg {outputs}" in result.stdout
    status_file = outputs / "bg" / "status.json"
    deadline = time.monotonic() + TIMEOUT
    while not (status_file.is_file() and json.loads(status_file.read_text())["step"] >= 10):
        assert time.monotonic() < deadline, "no progress"
        time.sleep(0.2)
    result = run([str(ROOT / "scripts/runs.py"), "stop", "bg", str(outputs), "--yes"], tmp_path)
    assert "sent SIGTERM" in result.stdout
    while json.loads(status_file.read_text())["status"] == "running":
        assert time.monotonic() < deadline, "the run did not stop"
        time.sleep(0.2)
    stopped = json.loads(status_file.read_text())
    assert stopped["status"] == "preempted" and stopped["step"] < 100000
    assert "saved checkpoint" in (outputs / "bg" / "launch.log").read_text()

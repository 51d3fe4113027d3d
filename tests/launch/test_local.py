"""End to end on CPU: the local backend trains with 2 processes, stops on Ctrl-C or `runs.py stop`
with a checkpoint, and the same command continues the run. Sweeps: test_sweeps.py (a file of its
own, so that `make test`'s two workers share these slow runs)."""

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

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
def test_local_ctrl_c_checkpoints_and_the_same_command_resumes(tmp_path, mds, capsys):
    """Stopped by Ctrl-C, continued by the same command: the continuation is also the end to
    end check of a whole local run (2 processes, its eval, status file and `runs.py` row), which
    needs no launch of its own."""
    outputs = tmp_path / "outputs"
    train = [
        f"data.remote={mds}",
        *TINY,
        "max_duration=80ba",
        "eval_interval=40ba",
        "callbacks=[]",
        "loggers=[console,jsonl]",
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
    result = run(command[1:], cwd=tmp_path)
    assert "local: 1 node(s) x 2 CPU processes" in result.stdout
    folder = outputs / "ctrl-c"
    status = json.loads(status_file.read_text())
    assert (status["status"], status["step"], status["world_size"]) == ("finished", 80, 2)
    latest = (folder / "checkpoints" / "latest").read_text().strip()
    assert latest == "ep10-ba80"  # 8 batches an epoch
    log = (folder / "launch.log").read_text()
    _, loaded, continued = log.partition(f"loaded checkpoint {outputs}/ctrl-c/checkpoints/ep")
    assert loaded and "eval/val/loss: first" in continued
    assert load_script("runs").main([str(outputs)]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("ctrl-c"))
    assert row.split()[1:3] == ["finished", "80/80"]


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

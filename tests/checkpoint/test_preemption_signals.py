"""One Ctrl-C is one stop, however many copies of the signal arrive; a later one aborts."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from llmfoundry.checkpoint import Preemption, read_latest
from llmfoundry.checkpoint import preemption as preemption_module

from .helpers import write_mds

ROOT = Path(__file__).resolve().parents[2]


def test_repeat_within_the_window_is_the_same_stop():
    with Preemption() as preemption:
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)  # torchrun's agent forwarding the same Ctrl-C
        time.sleep(0.05)
        assert preemption.signal is signal.SIGINT


def test_repeat_after_the_window_stops_at_once(monkeypatch):
    monkeypatch.setattr(preemption_module, "REPEAT_WINDOW_S", 0.0)
    with Preemption() as preemption, pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)
        assert preemption.signal is signal.SIGINT
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)


def test_a_signal_ignored_when_the_run_started_stays_ignored():
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with Preemption() as preemption:
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) == preemption._handle
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
            assert preemption.signal is None
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.mark.slow
def test_ctrl_c_under_torchrun_saves_once_and_the_workers_exit_cleanly(tmp_path):
    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists():
        pytest.skip("torchrun not installed next to this Python")
    data = write_mds(tmp_path / "mds", {"train": 64, "val": 8})
    process = subprocess.Popen(
        [
            str(torchrun),
            "--standalone",
            "--nproc_per_node=2",
            str(ROOT / "scripts" / "train.py"),
            "strategy=ddp",
            f"data.remote={data}",
            "model.d_model=32",
            "model.n_heads=2",
            "model.n_layers=1",
            "model.max_seq_len=16",
            "model.vocab_size=64",
            "global_train_batch_size=4",
            "max_duration=100000ba",
            "scheduler.t_warmup=1ba",
            "eval_interval=null",
            "callbacks=[]",
            "loggers=[console]",
            "loggers.console.log_interval=1ba",
            "run_name=ctrl-c",
            f"save_folder={tmp_path / 'ckpt'}",
            "save_interval=null",
        ],  # fmt: skip
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a terminal's foreground job
    )
    seen = []
    try:
        for line in process.stdout:
            seen.append(line.rstrip("\n"))
            if line.startswith("[batch 5]"):
                break
        os.killpg(process.pid, signal.SIGINT)  # what Ctrl-C does: the whole process group
        out, err = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    lines = seen + out.splitlines()
    # One line per event (rank 0 only, each once), and no worker died mid-save.
    for event in ("received SIGINT", "preempted: stopped after batch", "saved checkpoint"):
        assert sum(event in line for line in lines) == 1, (event, out)
    assert sum("[batch 3] " in line for line in lines) == 1, out
    assert "KeyboardInterrupt" not in err and "ChildFailedError" not in err, err
    stopped = next(line for line in lines if line.startswith("preempted"))
    assert read_latest(str(tmp_path / "ckpt")).endswith(f"ba{stopped.split()[-1]}")

"""Preemption, crash and autoresume through `scripts/train.py`, as a user runs it.

One run is launched three times with the same command line: SIGTERM arrives during batch 4
(it saves and exits 0), then the process is SIGKILLed after batch 8 (the last checkpoint is at
batch 6), then it finishes. Every step it logged, repeated ones included, matches a straight run
of the same command bit for bit, and reads the same samples; its metrics file misses no step.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from llmfoundry.checkpoint import read_latest
from llmfoundry.loggers.plot import read_metrics

from .helpers import INTERRUPT_ENV, read_steps, write_mds

pytestmark = pytest.mark.slow  # runs scripts in subprocesses; `make test-fast` skips it

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 120


@pytest.fixture(scope="module")
def mds(tmp_path_factory):
    return write_mds(tmp_path_factory.mktemp("mds"), {"train": 24, "val": 8})


def launch(tmp_path, mds, name, interrupt=None, overrides=("autoresume=true",)):
    """Start the run `name`; its checkpoints and step log live in tmp_path/name."""
    command = [
        sys.executable,
        str(ROOT / "scripts" / "train.py"),
        f"run_name={name}",
        f"data.remote={mds}",
        "data.shuffle_block_size=8",
        "model.d_model=32",
        "model.n_heads=2",
        "model.n_layers=2",
        "model.max_seq_len=16",
        "model.vocab_size=64",
        "model.resid_pdrop=0.1",
        "global_train_batch_size=4",
        "max_duration=10ba",
        "scheduler.t_warmup=2ba",
        "eval_interval=4ba",
        "eval_first=false",
        "eval_subset_num_batches=2",
        f"save_folder={tmp_path / name / 'ckpt'}",
        "save_interval=3ba",
        *overrides,
        "callbacks=[]",
        "loggers=[console,jsonl]",  # jsonl: flush_interval 10ba, the default
        "+callbacks.steps._target_=tests.checkpoint.helpers.StepRecorder",
        f"+callbacks.steps.path={tmp_path / name / 'steps.jsonl'}",
    ]
    (tmp_path / name).mkdir(exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop(INTERRUPT_ENV, None)
    if interrupt:
        env[INTERRUPT_ENV] = interrupt
    return subprocess.Popen(
        command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def finish(process):
    out, err = process.communicate(timeout=TIMEOUT)
    return process.returncode, out, err


def test_preempt_crash_and_autoresume_match_a_straight_run(tmp_path, mds):
    reference = launch(tmp_path, mds, "straight")
    run = tmp_path / "run"

    # 1. Preemption: SIGTERM while batch 4 is running; the run saves after it and exits 0.
    process = launch(tmp_path, mds, "run", interrupt="SIGTERM@4")
    at, deadline = run / "steps.jsonl.at", time.monotonic() + TIMEOUT
    while not at.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert at.exists(), process.communicate()[1]
    process.send_signal(signal.SIGTERM)
    (run / "steps.jsonl.sent").touch()
    code, out, err = finish(process)
    assert code == 0, err
    assert "Traceback" not in err and "received SIGTERM" in out
    assert "preempted: stopped after batch 4" in out
    assert read_latest(str(run / "ckpt")) == "ep0-ba4"

    # 2. The same command continues from batch 4 and is killed (SIGKILL) after batch 8.
    code, out, err = finish(launch(tmp_path, mds, "run", interrupt="SIGKILL@8"))
    assert code == -signal.SIGKILL, err
    assert "loaded checkpoint" in out and "(epoch 0, batch 4)" in out
    assert read_latest(str(run / "ckpt")) == "ep0-ba6"

    # 3. The same command again: continues from batch 6 and finishes.
    code, out, err = finish(launch(tmp_path, mds, "run"))
    assert code == 0, err
    assert "(epoch 0, batch 6)" in out

    code, _, err = finish(reference)
    assert code == 0, err
    expected = read_steps(tmp_path / "straight" / "steps.jsonl")
    assert [s["batch"] for s in expected] == list(range(1, 11))
    assert sorted(sum((s["ids"] for s in expected[:6]), [])) == list(range(24))
    steps = read_steps(run / "steps.jsonl")
    # Batches 7 and 8 ran twice (after the crash they were redone from batch 6): identically.
    assert [s["batch"] for s in steps] == [1, 2, 3, 4, 5, 6, 7, 8, 7, 8, 9, 10]
    assert steps == [expected[s["batch"] - 1] for s in steps]
    # The metrics file has every step: those up to the kill's last checkpoint (batches 5 and 6,
    # not yet due for a flush when the kill came) were flushed when it was saved; those after
    # it were logged again by the resumed run. Its losses are the straight run's.
    metrics = read_metrics(tmp_path / "outputs" / "run" / "metrics.jsonl")
    straight = read_metrics(tmp_path / "outputs" / "straight" / "metrics.jsonl")
    assert metrics["loss/train"][0] == list(range(1, 11))
    assert metrics["loss/train"] == straight["loss/train"]

"""A run's folders are its own, through `scripts/train.py` as a user runs it: a rerun of a
run_name without autoresume is refused, and so is a second launch while the run trains.
(A file of its own beside test_train_script.py, so that `make test`'s two workers share them.)
"""

import signal
import socket
import time

import pytest

from llmfoundry.checkpoint import read_latest

from .helpers import write_mds
from .test_train_script import TIMEOUT, finish, launch

pytestmark = pytest.mark.slow  # runs scripts in subprocesses; `make test-fast` skips it


@pytest.fixture(scope="module")
def mds(tmp_path_factory):
    return write_mds(tmp_path_factory.mktemp("mds"), {"train": 24, "val": 8})


def test_a_rerun_or_a_second_launch_never_writes_over_a_run(tmp_path, mds):
    """Rerunning a run_name without autoresume is refused; so is a launch while it runs."""
    status = "+callbacks.run_status._target_=llmfoundry.callbacks.RunStatus"
    fresh = ("autoresume=false", "max_duration=3ba", status)
    code, _, err = finish(launch(tmp_path, mds, "mine", overrides=fresh))
    assert code == 0, err
    folder = tmp_path / "mine" / "ckpt"
    saved = (folder / "ep0-ba3" / "manifest.json").read_bytes()
    status_file = tmp_path / "outputs" / "mine" / "status.json"
    finished = status_file.read_bytes()

    code, out, err = finish(launch(tmp_path, mds, "mine", overrides=fresh))
    assert code != 0
    assert f"save_folder {folder} already holds checkpoints up to ep0-ba3" in err
    assert "autoresume=true" in err and "save_overwrite=true" in err
    assert "loaded checkpoint" not in out
    assert (folder / "ep0-ba3" / "manifest.json").read_bytes() == saved
    assert read_latest(str(folder)) == "ep0-ba3"
    # The refused relaunch never started: the run's status still says it finished (runs.py).
    assert status_file.read_bytes() == finished

    # While the run continues (held at batch 4), a second launch of it stops at once.
    running = launch(tmp_path, mds, "mine", interrupt="SIGTERM@4")
    at, deadline = tmp_path / "mine" / "steps.jsonl.at", time.monotonic() + TIMEOUT
    while not at.exists() and running.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert at.exists(), running.communicate()[1]
    code, _, err = finish(launch(tmp_path, mds, "mine"))
    assert code != 0
    assert f"is in use by another run (host {socket.gethostname()}, pid {running.pid}" in err
    running.send_signal(signal.SIGTERM)
    (tmp_path / "mine" / "steps.jsonl.sent").touch()
    code, _, err = finish(running)
    assert code == 0, err
    assert read_latest(str(folder)) == "ep0-ba4"

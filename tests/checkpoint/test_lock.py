"""Folder locks: flock on local folders (dies with its process), a renewed lease on S3 (moto)."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import fsspec
import pytest

from llmfoundry.checkpoint import CheckpointError, probe_writable
from llmfoundry.checkpoint.lock import FolderLock

HOLD = """
import sys, time
from llmfoundry.checkpoint.lock import FolderLock
lock = FolderLock(sys.argv[1], "run folder").acquire()
print("held", flush=True)
time.sleep(60)
"""


def test_local_lock_names_its_holder_and_dies_with_the_process(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(CheckpointError) as err:
            FolderLock(str(tmp_path), "run folder").acquire()
        message = str(err.value)
        assert f"run folder {tmp_path} is in use by another run" in message
        assert f"host {socket.gethostname()}, pid {holder.pid}, since " in message
        assert "\n" not in message
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(10)
    FolderLock(str(tmp_path), "run folder").acquire().close()  # a killed run blocks nobody


def test_local_lock_is_released_by_close(tmp_path):
    lock = FolderLock(str(tmp_path), "save_folder").acquire()
    with pytest.raises(CheckpointError, match="save_folder .* is in use"):
        FolderLock(str(tmp_path), "save_folder").acquire()
    lock.close()
    FolderLock(str(tmp_path), "save_folder").acquire().close()


@pytest.fixture
def bucket(s3_env):
    pytest.importorskip("s3fs")
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    name = f"lock-{time.monotonic_ns()}"
    fs.mkdir(name)
    return fs, f"s3://{name}/runs/a/ckpt"


def test_s3_lease_is_renewed_refused_to_others_and_removed_on_close(bucket):
    fs, url = bucket
    lock = FolderLock(url, "save_folder", lease_seconds=3).acquire()
    first = json.loads(fs.cat_file(f"{url}/.lock"))
    assert first["pid"] == os.getpid() and first["expires"] > time.time()
    time.sleep(1.5)  # renewed (every third of the lease) meanwhile
    fs.invalidate_cache()
    assert json.loads(fs.cat_file(f"{url}/.lock"))["expires"] > first["expires"]
    with pytest.raises(CheckpointError) as err:
        FolderLock(url, "save_folder").acquire()
    assert f"save_folder {url} is in use by another run (host " in str(err.value)
    assert "lease expires at" in str(err.value) and f"delete {url}/.lock" in str(err.value)
    lock.close()
    fs.invalidate_cache()
    assert not fs.exists(f"{url}/.lock")
    FolderLock(url, "save_folder").acquire().close()


def test_s3_lease_of_a_dead_run_is_taken_over(bucket):
    fs, url = bucket
    lease = {"host": "elsewhere", "pid": 1, "since": 0, "token": "x"}
    fs.pipe_file(f"{url}/.lock", json.dumps({**lease, "expires": time.time() - 1}).encode())
    FolderLock(url, "save_folder").acquire().close()  # expired
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    here = {**lease, "host": socket.gethostname(), "pid": int(dead.stdout)}
    fs.pipe_file(f"{url}/.lock", json.dumps({**here, "expires": time.time() + 600}).encode())
    FolderLock(url, "save_folder").acquire().close()  # its process on this machine is gone
    fs.pipe_file(f"{url}/.lock", json.dumps({**lease, "expires": time.time() + 600}).encode())
    with pytest.raises(CheckpointError, match="host elsewhere, pid 1"):
        FolderLock(url, "save_folder").acquire()


def test_write_probe_on_s3(bucket):
    fs, url = bucket
    probe_writable(url)
    fs.invalidate_cache()
    assert fs.ls(url.removeprefix("s3://").split("/")[0], detail=False) == []  # probe removed
    with pytest.raises(
        CheckpointError, match=r"save_folder s3://no-such-bucket-x/c is not writable"
    ):
        probe_writable("s3://no-such-bucket-x/c")


def test_a_run_whose_lease_was_taken_over_stops_before_its_next_save(bucket):
    fs, url = bucket
    lock = FolderLock(url, "save_folder", lease_seconds=0.6).acquire()
    lock.batch_end(None, None)  # still ours: nothing happens
    other = {"host": "elsewhere", "pid": 7, "since": 0, "token": "x", "expires": time.time() + 60}
    fs.pipe_file(f"{url}/.lock", json.dumps(other).encode())  # as after a pause past expiry
    time.sleep(0.6)
    with pytest.raises(CheckpointError, match=r"lost the lock on save_folder .* \(host elsewhere"):
        lock.batch_end(None, None)
    lock.close()
    assert json.loads(fs.cat_file(f"{url}/.lock"))["token"] == "x"  # theirs is left alone

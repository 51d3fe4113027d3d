"""An S3 save_folder through `scripts/train.py` as a user runs it, on a real S3 API (moto).
(A file of its own beside test_train_script.py, so that `make test`'s two workers share them.)
"""

import time

import pytest

from llmfoundry.checkpoint import read_latest

from .helpers import write_mds
from .test_train_script import TIMEOUT, finish, launch

pytestmark = pytest.mark.slow  # runs scripts in subprocesses; `make test-fast` skips it


@pytest.fixture(scope="module")
def mds(tmp_path_factory):
    return write_mds(tmp_path_factory.mktemp("mds"), {"train": 24, "val": 8})


def test_an_s3_save_folder_is_probed_at_start_and_locked_while_the_run_lives(tmp_path, mds, s3_env):
    """On a real S3 API (moto): a bucket that is not there fails before training; a good one
    gets the checkpoints, and the run's lease is gone when it ends."""
    pytest.importorskip("s3fs")
    import fsspec

    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    bucket = f"runs-{time.monotonic_ns()}"
    started = time.monotonic()
    missing = f"save_folder=s3://{bucket}-missing/ckpt"
    code, out, err = finish(launch(tmp_path, mds, "s3", overrides=(missing,)))
    assert code != 0
    assert f"save_folder s3://{bucket}-missing/ckpt is not writable" in err
    assert "step" not in out and not (tmp_path / "s3" / "steps.jsonl").exists()
    assert time.monotonic() - started < TIMEOUT

    fs.mkdir(bucket)
    url = f"s3://{bucket}/ckpt"
    code, _, err = finish(launch(tmp_path, mds, "s3", overrides=(f"save_folder={url}",)))
    assert code == 0, err
    fs.invalidate_cache()
    assert read_latest(url) == "ep1-ba10"
    assert not fs.exists(f"{url}/.lock")

"""Checkpoint integrity: the manifest (every file's size and SHA-256, written last), corrupt and
partial checkpoints, NaN weights, a full disk, what killed saves leave behind."""

import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import uuid

import fsspec
import pytest
import safetensors.torch
import torch

from llmfoundry.callbacks import CheckpointSaver
from llmfoundry.checkpoint import (
    CheckpointError,
    clean,
    find_checkpoint,
    read_checkpoint,
    read_latest,
    writer,
)
from llmfoundry.checkpoint.manifest import hash_tree, manifest_bytes
from llmfoundry.trainer import Callback

from ..trainer.conftest import token_batches
from .helpers import Batches
from .test_checkpoint import folders, make_trainer


def saved_run(tmp_path, batches=3, keep=-1):
    folder = tmp_path / "ckpt"
    saver = CheckpointSaver(str(folder), save_interval="1ba", num_checkpoints_to_keep=keep)
    make_trainer(tmp_path, Batches(token_batches(batches, 2)), saver=saver).fit()
    return folder


def flip_byte(path, offset=None):
    data = bytearray(path.read_bytes())
    offset = len(data) // 2 if offset is None else offset
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_manifest_lists_every_file_with_size_and_sha256(tmp_path):
    checkpoint = saved_run(tmp_path, batches=1) / "ep0-ba1"
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    assert manifest["algorithm"] == "sha256"
    assert sorted(manifest["files"]) == ["model.safetensors", "rng-rank0.pt", "state.pt"]
    entry = manifest["files"]["model.safetensors"]
    assert entry["size"] == (checkpoint / "model.safetensors").stat().st_size
    assert len(entry["sha256"]) == 64


def test_a_flipped_byte_in_the_weights_is_named_on_load(tmp_path):
    folder = saved_run(tmp_path, batches=2)
    weights = folder / "ep0-ba2" / "model.safetensors"
    flip_byte(weights)  # a bit flip in a weight: safetensors itself would load it silently
    assert safetensors.torch.load_file(weights)  # (it does)
    with pytest.raises(CheckpointError, match=f"{weights} is corrupt") as err:
        make_trainer(tmp_path, Batches(token_batches(2, 2)), load_path=str(folder))
    assert "\n" not in str(err.value)


def write_shards(path):
    (path / "0").mkdir(parents=True)
    (path / "0" / "__0_0.distcp").write_bytes(b"shard bytes")


def test_every_listed_file_is_checked_including_folders_of_shards(tmp_path):
    """A writer may write a folder (sharded checkpoints): its files are listed and verified."""
    files = {
        "model.safetensors": writer.write_tensors({"w": torch.ones(3)}),
        "state.pt": writer.write_object({"format_version": 1}),
        "sharded": write_shards,
    }
    for url in (str(tmp_path / "local"), f"memory://integrity-{uuid.uuid4().hex}"):
        writer.write_checkpoint(url, "ep0-ba1", files)
        fs, root = fsspec.core.url_to_fs(url)
        listed = json.loads(fs.cat_file(f"{root}/ep0-ba1/manifest.json"))["files"]
        assert sorted(listed) == ["model.safetensors", "sharded/0/__0_0.distcp", "state.pt"]
        assert read_checkpoint(url, 0).model["w"].tolist() == [1.0, 1.0, 1.0]
        fs.pipe_file(f"{root}/ep0-ba1/sharded/0/__0_0.distcp", b"shard bytez")
        with pytest.raises(CheckpointError, match=r"sharded/0/__0_0\.distcp is corrupt"):
            read_checkpoint(f"{url}/ep0-ba1", 0)


def test_a_damaged_newest_checkpoint_is_skipped_by_resume_and_named_when_loaded(tmp_path):
    folder = saved_run(tmp_path)
    state = folder / "ep0-ba3" / "state.pt"
    state.write_bytes(state.read_bytes()[:100])  # a partial copy
    assert find_checkpoint(str(folder)) == "ep0-ba2"
    with pytest.raises(CheckpointError, match=r"state\.pt \(100 bytes, the manifest says"):
        read_checkpoint(str(folder / "ep0-ba3"), 0)
    (folder / "ep0-ba2" / "manifest.json").unlink()  # as a save cut short leaves it
    assert find_checkpoint(str(folder)) == "ep0-ba1"
    with pytest.raises(CheckpointError, match="has no manifest.json: its save was cut short,"):
        read_checkpoint(str(folder / "ep0-ba2"), 0)


class PoisonWeights(Callback):
    """Training diverges at batch `at` (the weights turn NaN), with no nan_detector to stop it."""

    def __init__(self, at):
        self.at = at

    def batch_end(self, state, logger):
        if state.timestamp.batch == self.at:
            with torch.no_grad():
                next(state.model.parameters()).fill_(float("nan"))


def test_nan_weights_are_never_saved_over_good_checkpoints(tmp_path):
    folder = tmp_path / "ckpt"
    saver = CheckpointSaver(str(folder), save_interval="1ba", num_checkpoints_to_keep=2)
    trainer = make_trainer(
        tmp_path, Batches(token_batches(4, 2)), saver=saver, callbacks=[PoisonWeights(at=3)]
    )
    with pytest.raises(
        CheckpointError, match="holds NaN or infinity .* earlier checkpoints are kept"
    ):
        trainer.fit()
    assert read_latest(str(folder)) == "ep0-ba2"
    assert folders(folder) == ["ep0-ba1", "ep0-ba2", "latest"]


def fail_writing(monkeypatch, filename, error):
    original = writer.write_checkpoint

    def write(folder, name, files):
        files = dict(files)
        if name == "ep0-ba2":

            def broken(path):
                path.write_bytes(b"half a file")
                raise error(path)

            files[filename] = broken
        return original(folder, name, files)

    monkeypatch.setattr("llmfoundry.checkpoint.state_dict.write_checkpoint", write)


def test_disk_full_is_one_line_naming_the_file_and_latest_is_kept(tmp_path, monkeypatch):
    fail_writing(
        monkeypatch,
        "model.safetensors",
        lambda path: OSError(errno.ENOSPC, "No space left on device", str(path)),
    )
    folder = tmp_path / "ckpt"
    saver = CheckpointSaver(str(folder), save_interval="1ba")
    with pytest.raises(CheckpointError) as err:
        make_trainer(tmp_path, Batches(token_batches(3, 2)), saver=saver).fit()
    message = str(err.value)
    assert "\n" not in message
    assert "no space left on the device writing" in message and "model.safetensors" in message
    assert "free space" in message and "still names the previous one" in message
    assert read_latest(str(folder)) == "ep0-ba1"
    assert folders(folder) == ["ep0-ba1", "latest"]  # no staging or scratch folder left


def test_disk_full_while_replacing_latest_keeps_the_old_pointer(tmp_path, monkeypatch):
    folder = saved_run(tmp_path, batches=1)

    def full(path, data):
        raise OSError(errno.ENOSPC, "No space left on device", f"{path}.tmp.1.x")

    monkeypatch.setattr(writer, "atomic_write", full)
    with pytest.raises(CheckpointError, match="no space left on the device writing .*latest"):
        writer.write_checkpoint(
            str(folder), "ep2-ba9", {"state.pt": writer.write_object({"format_version": 1})}
        )
    assert read_latest(str(folder)) == "ep0-ba1"


def test_an_upload_cut_short_never_counts_and_is_cleaned(tmp_path, monkeypatch):
    """On an object store the files of a killed save are there without their manifest."""
    url = f"memory://cut-{uuid.uuid4().hex}/ckpt"
    saver = CheckpointSaver(url, save_interval="1ba")
    make_trainer(tmp_path, Batches(token_batches(1, 2)), saver=saver).fit()
    fs, root = fsspec.core.url_to_fs(url)
    fs.pipe_file(f"{root}/ep1-ba2/state.pt", b"the first bytes of a state.pt")
    fs.pipe_file(f"{root}/latest.tmp.77.abc", b"ep1-ba2\n")
    assert find_checkpoint(url) == "ep0-ba1"
    assert sorted(clean(url)) == ["ep1-ba2", "latest.tmp.77.abc"]
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)) == [
        "ep0-ba1",
        "latest",
    ]


KILLED_MID_SAVE = """
import os, signal, sys, torch
from llmfoundry.checkpoint import writer

def model(path):
    path.write_bytes(b"the first half of the weights")
    os.kill(os.getpid(), signal.SIGKILL)

files = {"model.safetensors": writer.write_tensors({"w": torch.ones(2)}),
         "state.pt": writer.write_object({"format_version": 1})}
writer.write_checkpoint(sys.argv[1], "ep0-ba1", files)
writer.write_checkpoint(sys.argv[1], "ep0-ba2", {**files, "model.safetensors": model})
"""


@pytest.mark.parametrize("store", ["local", "s3"])
def test_a_kill_during_a_save_leaves_no_checkpoint_that_counts(tmp_path, store, request):
    if store == "s3":
        request.getfixturevalue("s3_env")
        fs = fsspec.filesystem("s3", skip_instance_cache=True)
        bucket = f"killed-{uuid.uuid4().hex[:8]}"
        fs.mkdir(bucket)
        url = f"s3://{bucket}/ckpt"
    else:
        url = str(tmp_path / "ckpt")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    killed = subprocess.run([sys.executable, "-c", KILLED_MID_SAVE, url], env=env, timeout=120)
    assert killed.returncode == -signal.SIGKILL
    assert read_latest(url) == "ep0-ba1"
    assert find_checkpoint(url) == "ep0-ba1"
    assert read_checkpoint(url, 0).path.endswith("ep0-ba1")
    clean(url)  # what the next launch does before its first save
    fs, root = fsspec.core.url_to_fs(url, skip_instance_cache=True)
    assert sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)) == [
        "ep0-ba1",
        "latest",
    ]


@pytest.fixture(scope="module")
def one_checkpoint(tmp_path_factory):
    return saved_run(tmp_path_factory.mktemp("one"), batches=1) / "ep0-ba1"


@pytest.mark.parametrize("name", ["state.pt", "rng-rank0.pt", "model.safetensors"])
@pytest.mark.parametrize(
    "junk", [b"garbage" * 9, b"PK\x03\x04\x00\x00\x08\x08" + bytes(56)], ids=["bytes", "cut-zip"]
)
def test_a_file_that_matches_its_manifest_but_does_not_parse_is_one_line_naming_it(
    one_checkpoint, tmp_path, name, junk
):
    """Damaged before it was hashed: whatever torch.load or safetensors raise (an OSError from a
    cut zip archive escaped before) is one line with the file and the reason."""
    checkpoint = tmp_path / "ep0-ba1"
    shutil.copytree(one_checkpoint, checkpoint)
    (checkpoint / name).write_bytes(junk)
    entries = json.loads((checkpoint / "manifest.json").read_text())["files"]
    (checkpoint / "manifest.json").write_bytes(
        manifest_bytes({**entries, name: hash_tree(checkpoint)[name]})
    )
    with pytest.raises(
        CheckpointError, match=rf"cannot read file://{checkpoint}/{name}: \w+"
    ) as err:
        read_checkpoint(str(checkpoint), 0)
    message = str(err.value)
    assert "\n" not in message and "load an earlier checkpoint" in message
    assert "In PyTorch 2.6" not in message  # torch's advice, not the reason


def closed_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_checkpoint_url_is_one_line_naming_it(monkeypatch):
    from llmfoundry.checkpoint.pretrained import load_pretrained
    from llmfoundry.utils import storage

    port = closed_port()
    url = f"https://127.0.0.1:{port}/runs/a/ckpt"
    for load in (lambda: read_checkpoint(url, 0), lambda: load_pretrained(url)):
        with pytest.raises(CheckpointError) as err:
            load()
        message = str(err.value)
        assert message.startswith(f"cannot read the checkpoint at {url} (ClientConnectorError: ")
        assert "\n" not in message and "check the URL, the network" in message
    pytest.importorskip("s3fs")
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.setenv(key, "testing")
    endpoint = f"http://127.0.0.1:{port}"
    retries = {"retries": {"max_attempts": 1}, "connect_timeout": 1}
    storage.configure({"endpoint_url": endpoint, "config_kwargs": retries})
    with pytest.raises(CheckpointError, match=r"^cannot read the checkpoint at s3://b/ckpt \(End"):
        read_checkpoint("s3://b/ckpt", 0)

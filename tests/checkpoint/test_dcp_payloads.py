"""A sharded (DCP) checkpoint cannot run code when loaded: a payload in ``sharded/.metadata``
or in a non-tensor value of the shards, with a manifest recomputed as its author would, is
refused with one line naming the file, in the scripts' load (`load_pretrained`) and in
``load_path=``; a genuine one still loads. In one process: a single-device strategy that
writes sharded checkpoints writes the same DCP files as FSDP's ranks."""

import functools
import os
import pickle
import shlex
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from llmfoundry.callbacks import CheckpointSaver
from llmfoundry.checkpoint import CheckpointError
from llmfoundry.checkpoint.manifest import MANIFEST, hash_tree, manifest_bytes
from llmfoundry.checkpoint.pretrained import load_pretrained
from llmfoundry.distributed import SingleDevice
from llmfoundry.optim import DecoupledAdamW

from ..trainer.conftest import token_batches
from .helpers import Batches
from .test_checkpoint import make_trainer

MODEL = {
    "_target_": "llmfoundry.models.mpt.MPTConfig",
    **{"d_model": 32, "n_heads": 2, "n_layers": 2, "max_seq_len": 16, "vocab_size": 64},
}


class ShardedSingleDevice(SingleDevice):
    sharded_checkpoints = True


class Payload:
    """What an attacker pickles: unpickling it runs a shell command that creates `marker`."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {shlex.quote(str(self.marker))}",))


def train(tmp_path, **kwargs):
    return make_trainer(
        tmp_path,
        Batches(token_batches(2, 2)),
        strategy=ShardedSingleDevice("cpu"),
        optimizer=functools.partial(DecoupledAdamW, lr=1e-2),
        config={"model": MODEL},
        **kwargs,
    )


@pytest.fixture(scope="module")
def genuine(tmp_path_factory):
    """A genuine sharded checkpoint (model, optimizer, state.pt) after 2 batches."""
    tmp = tmp_path_factory.mktemp("dcp")
    saver = CheckpointSaver(str(tmp / "ckpt"), save_interval="2ba")
    train(tmp, saver=saver).fit()
    checkpoint = tmp / "ckpt" / "ep0-ba2"
    assert (checkpoint / "sharded" / ".metadata").is_file()
    return checkpoint


def forged(genuine, tmp_path, plant):
    """A copy of `genuine` changed by `plant(shards_folder)`, its manifest recomputed."""
    checkpoint = tmp_path / "forged" / "ep0-ba2"
    shutil.copytree(genuine, checkpoint)
    plant(checkpoint / "sharded")
    (checkpoint / MANIFEST).unlink()
    (checkpoint / MANIFEST).write_bytes(manifest_bytes(hash_tree(checkpoint)))
    return checkpoint


def test_a_genuine_sharded_checkpoint_loads_in_the_scripts_and_in_load_path(genuine, tmp_path):
    model, _ = load_pretrained(str(genuine))
    resumed = train(tmp_path, load_path=str(genuine))
    assert resumed.state.timestamp.batch == 2
    for name, tensor in resumed.state.model.state_dict().items():
        assert torch.equal(tensor, model.state_dict()[name]), name


def test_a_payload_in_the_metadata_is_refused_and_never_runs(genuine, tmp_path):
    marker = tmp_path / "ran"
    metadata = lambda shards: (shards / ".metadata").write_bytes(pickle.dumps(Payload(marker)))  # noqa: E731
    checkpoint = forged(genuine, tmp_path, metadata)
    refusal = r"refusing to load .*sharded/\.metadata: it is not DCP checkpoint metadata"
    with pytest.raises(CheckpointError, match=refusal) as err:
        load_pretrained(str(checkpoint))  # generate.py, serve.py, export_hf.py, convert
    assert "\n" not in str(err.value)
    with pytest.raises(CheckpointError, match=refusal):
        train(tmp_path, load_path=str(checkpoint.parent))  # train.py load_path=
    assert not marker.exists()


def test_a_payload_in_an_optimizer_value_of_the_shards_is_refused_and_never_runs(genuine, tmp_path):
    """DCP's planner reads non-tensor values (hyperparameters) with weights_only=False."""
    marker = tmp_path / "ran"

    def hyperparameter(shards):
        whole = tmp_path / "whole.pt"
        dcp_to_torch_save(shards, whole)  # the author's own genuine state, as one file
        state = torch.load(whole, weights_only=False)
        optimizer = state["optimizer"]  # flat, groups by parameter name (sharded_state)
        lr = next(k for k in optimizer if k.startswith("param_groups.") and k.endswith(".lr"))
        optimizer[lr] = Payload(marker)
        shutil.rmtree(shards)
        dcp.save(state, checkpoint_id=str(shards), no_dist=True)

    checkpoint = forged(genuine, tmp_path, hyperparameter)
    with pytest.raises(CheckpointError, match=r"refusing to load 'optimizer\.param_groups") as err:
        train(tmp_path, load_path=str(checkpoint))
    assert "\n" not in str(err.value)
    assert not marker.exists()


def test_a_truncated_shard_is_named_whether_loaded_by_its_save_folder_or_its_folder(
    genuine, tmp_path
):
    checkpoint = tmp_path / "copy" / "ep0-ba2"
    shutil.copytree(genuine, checkpoint)
    shard = next((checkpoint / "sharded").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])  # a partial copy; the manifest is the original
    damage = rf"sharded/{shard.name} \(100 bytes, the manifest says"
    for load_path, named in (
        (checkpoint.parent, rf"its newest, {checkpoint}, is incomplete: {damage}"),
        (checkpoint, rf"checkpoint {checkpoint} is incomplete: {damage}"),
    ):
        with pytest.raises(CheckpointError, match=named) as err:
            train(tmp_path, load_path=str(load_path))
        assert "\n" not in str(err.value) and "an earlier checkpoint" in str(err.value)
    with pytest.raises(CheckpointError, match=rf"{checkpoint}, is incomplete: {damage}"):
        load_pretrained(str(checkpoint.parent))  # generate.py, serve.py, export_hf.py


@pytest.mark.parametrize("junk", [b"x" * 64, b"PK\x03\x04" + bytes(60)], ids=["bytes", "zip"])
def test_a_shard_that_matches_its_manifest_but_does_not_parse_is_one_line_naming_it(
    genuine, tmp_path, junk
):
    """Damaged before it was hashed (or written by another program): DCP's traceback before."""
    checkpoint = forged(
        genuine, tmp_path, lambda shards: next(shards.glob("*.distcp")).write_bytes(junk)
    )
    named = rf"cannot read the shard {checkpoint}/sharded/__0_0\.distcp: \w+Error[:;] "
    for load in (
        lambda: train(tmp_path, load_path=str(checkpoint)),
        lambda: load_pretrained(str(checkpoint)),
    ):
        with pytest.raises(CheckpointError, match=named) as err:
            load()
        assert "\n" not in str(err.value) and "load an earlier checkpoint" in str(err.value)


def test_metadata_that_does_not_parse_is_named_as_damaged_not_as_a_payload(genuine, tmp_path):
    checkpoint = forged(genuine, tmp_path, lambda shards: (shards / ".metadata").write_bytes(b"x"))
    with pytest.raises(
        CheckpointError, match=r"sharded/\.metadata: it does not parse as DCP"
    ) as err:
        load_pretrained(str(checkpoint))
    assert "could run code" not in str(err.value) and "load an earlier checkpoint" in str(err.value)


def test_reading_shards_in_one_process_warns_nothing(tmp_path):
    """convert_checkpoint.py and export read a sharded checkpoint without a process group on
    purpose: torch's 'assuming ... a single process' warning must not reach the user."""
    import warnings

    from llmfoundry.checkpoint.sharded import full_model_state

    weights = {"w": torch.arange(6.0).reshape(2, 3)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": weights}, checkpoint_id=str(tmp_path), no_dist=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(full_model_state(str(tmp_path))["w"], weights["w"])


def test_a_resume_from_shards_keeps_this_runs_optimizer_hyperparameters(genuine, tmp_path):
    """As a whole checkpoint's optimizer (test_restart.py): a changed lr or betas apply
    from the resume on, with the schedule's position kept; loading the shards used to bring the
    saved values back while the warning said the new ones applied."""
    resumed = make_trainer(
        tmp_path,
        Batches(token_batches(2, 2)),
        strategy=ShardedSingleDevice("cpu"),
        optimizer=functools.partial(DecoupledAdamW, lr=5e-3, betas=(0.8, 0.9)),
        config={"model": MODEL},
        load_path=str(genuine),
    )
    groups = resumed.state.optimizer.param_groups
    assert {g["initial_lr"] for g in groups} == {5e-3}
    assert {g["betas"] for g in groups} == {(0.8, 0.9)}
    assert resumed.state.optimizer.state  # the moments still came from the shards

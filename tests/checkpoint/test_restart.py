"""A save folder that holds checkpoints is never written over silently (issue 13.1), one run per
folder (13.2), a save folder that cannot be written fails at start (14.2), and resuming with a
changed recipe (13.6): through build_trainer, as scripts/train.py does."""

import logging
from pathlib import Path

import pytest

from llmfoundry.build import build_trainer
from llmfoundry.checkpoint import CheckpointError, read_latest
from llmfoundry.config.preflight import compose_config

from .helpers import write_mds
from .test_checkpoint import folders

CONF = Path(__file__).resolve().parents[2] / "conf"


@pytest.fixture(scope="module")
def mds(tmp_path_factory):
    return write_mds(tmp_path_factory.mktemp("mds"), {"train": 24, "val": 8})


def build(tmp_path, mds, *overrides, run="run"):
    cfg = compose_config(
        CONF,
        [
            "model.d_model=32", "model.n_heads=2", "model.n_layers=2", "model.max_seq_len=16",
            "model.vocab_size=64", "global_train_batch_size=4", "max_duration=3ba",
            "callbacks=[]", "loggers=[]", "eval_first=false", "eval_interval=null",
            f"data.remote={mds}", "data.shuffle_block_size=8", "run_name=r",
            f"save_folder={tmp_path / run / 'ckpt'}", "save_interval=1ba",
            *overrides,
        ],
    )  # fmt: skip
    return build_trainer(cfg, tmp_path / run)


def test_autoresume_without_latest_continues_from_the_newest_complete_checkpoint(
    tmp_path, mds, caplog
):
    build(tmp_path, mds).fit()
    folder = tmp_path / "run" / "ckpt"
    (folder / "latest").unlink()  # deleted, or lost in a partial copy between buckets
    trainer = build(tmp_path, mds, "autoresume=true", "max_duration=4ba")
    assert trainer.state.timestamp.batch == 3
    assert "latest is missing; continuing from ep0-ba3" in caplog.text
    trainer.fit()
    assert read_latest(str(folder)) == "ep0-ba4"


def test_autoresume_when_the_only_checkpoint_is_damaged_names_it_and_the_file(tmp_path, mds):
    build(tmp_path, mds, "max_duration=1ba").fit()
    checkpoint = tmp_path / "run" / "ckpt" / "ep0-ba1"
    weights = checkpoint / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:64])  # a partial copy
    with pytest.raises(CheckpointError) as err:
        build(tmp_path, mds, "autoresume=true")
    message = str(err.value)
    assert "\n" not in message and "set autoresume=true" not in message
    assert f"its newest, {checkpoint}, is incomplete: model.safetensors (64 bytes," in message
    assert "delete it to start the run afresh" in message
    assert weights.exists()  # nothing was cleaned away


def test_a_rerun_without_autoresume_is_refused_and_the_checkpoints_stay(tmp_path, mds):
    build(tmp_path, mds).fit()
    folder = tmp_path / "run" / "ckpt"

    def checkpoints():  # every file but the lock, which each launch takes
        return {p: p.stat().st_mtime_ns for p in folder.rglob("*") if p.name != ".lock"}

    before = checkpoints()
    for extra in ([], ["num_checkpoints_to_keep=1"]):
        with pytest.raises(CheckpointError) as err:
            build(tmp_path, mds, *extra).fit()
        message = str(err.value)
        assert "\n" not in message
        assert f"save_folder {folder} already holds checkpoints up to ep0-ba3" in message
        for option in ("autoresume=true", "new run_name", "save_overwrite=true"):
            assert option in message
    assert checkpoints() == before


def test_save_overwrite_replaces_the_old_checkpoints_after_the_first_save(tmp_path, mds):
    build(tmp_path, mds, "max_duration=4ba", "save_interval=2ba").fit()
    folder = tmp_path / "run" / "ckpt"
    assert folders(folder) == [".lock", "ep0-ba2", "ep0-ba4", "latest"]
    build(tmp_path, mds, "save_overwrite=true", "max_duration=1ba").fit()
    assert folders(folder) == [".lock", "ep0-ba1", "latest"]
    assert read_latest(str(folder)) == "ep0-ba1"


def test_a_second_run_on_the_same_folders_is_refused_naming_the_holder(tmp_path, mds):
    first = build(tmp_path, mds)
    with pytest.raises(CheckpointError, match=r"run folder .* is in use by another run \(host "):
        build(tmp_path, mds)
    # Another run folder but the same save folder: the save folder's lock says no.
    with pytest.raises(CheckpointError, match=r"save_folder .* is in use by another run"):
        build(tmp_path, mds, f"save_folder={tmp_path / 'run' / 'ckpt'}", run="other")
    first.fit()  # training ends: the locks are released
    build(tmp_path, mds, "autoresume=true", "max_duration=4ba").fit()


def test_a_save_folder_that_cannot_be_written_fails_before_anything_is_built(tmp_path, mds):
    (tmp_path / "a-file").write_text("not a folder")
    with pytest.raises(CheckpointError, match=r"save_folder .*a-file/ckpt is not writable"):
        build(tmp_path, mds, f"save_folder={tmp_path / 'a-file' / 'ckpt'}")


@pytest.mark.parametrize(
    ("override", "refused"),
    [
        ("model.d_model=64", "model.d_model: 32 -> 64"),
        ("model.n_heads=4", "model.n_heads: 2 -> 4"),
        ("optimizer=decoupled_lionw", "optimizer._target_: 'llmfoundry.optim.DecoupledAdamW' ->"),
    ],
)
def test_resuming_into_another_model_or_optimizer_is_refused(tmp_path, mds, override, refused):
    build(tmp_path, mds).fit()
    with pytest.raises(CheckpointError, match="cannot continue with this config") as err:
        build(tmp_path, mds, "autoresume=true", "max_duration=4ba", override)
    assert refused in str(err.value) and "load_ignore_keys" in str(err.value)


def test_load_ignore_keys_opts_out_of_the_optimizer_check(tmp_path, mds):
    build(tmp_path, mds).fit()
    trainer = build(
        tmp_path,
        mds,
        f"load_path={tmp_path / 'run' / 'ckpt'}",
        "optimizer=decoupled_lionw",
        "load_ignore_keys=[optimizer]",
        "save_overwrite=true",
        run="lion",
    )
    assert trainer.state.timestamp.batch == 3


def test_a_changed_batch_size_or_lr_is_warned_about_and_takes_effect(tmp_path, mds, caplog):
    build(tmp_path, mds, "optimizer.lr=0.002").fit()
    caplog.set_level(logging.WARNING)
    trainer = build(
        tmp_path,
        mds,
        "autoresume=true",
        "max_duration=4ba",
        "global_train_batch_size=8",
        "optimizer.lr=0.0005",
    )
    assert "global_train_batch_size: 4 -> 8" in caplog.text
    assert "optimizer.lr: 0.002 -> 0.0005" in caplog.text
    assert "max_duration" not in caplog.text  # extending a run is not a change of recipe
    assert {g["initial_lr"] for g in trainer.state.optimizer.param_groups} == {0.0005}


def test_a_load_path_that_does_not_open_fails_before_the_data_is_read(tmp_path, mds):
    missing = tmp_path / "no-such-run" / "ckpt"
    with pytest.raises(FileNotFoundError, match=f"load_path '{missing}' is neither"):
        build(tmp_path, mds, f"load_path={missing}", f"data.remote={tmp_path / 'no-data'}")

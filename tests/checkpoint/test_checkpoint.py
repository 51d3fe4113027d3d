"""Checkpoint contents, storage (local and fsspec memory://), intervals, pruning, atomicity,
loading with ignored keys, and preemption in one process."""

import functools
import json
import logging
import os
import signal
import uuid

import fsspec
import numpy as np
import pytest
import torch

from llmfoundry.algorithms import RandomTokenReplacement
from llmfoundry.callbacks import CheckpointSaver
from llmfoundry.checkpoint import (
    WEIGHTS_ONLY,
    catalogue,
    check_ignore_keys,
    keys,
    latest_checkpoint,
    read_checkpoint,
    read_latest,
    state_dict,
    writer,
)
from llmfoundry.checkpoint.manifest import hash_tree, manifest_bytes
from llmfoundry.loggers import ConsoleLogger
from llmfoundry.optim import CosineWithWarmup, DecoupledAdamW
from llmfoundry.rng import load_rng_state, rng_state
from llmfoundry.trainer import Callback, Trainer
from llmfoundry.utils.errors import UserError

from ..trainer.conftest import tiny_model, token_batches
from .helpers import Batches


def make_trainer(tmp_path, batches, saver=None, **kwargs):
    kwargs.setdefault("max_duration", f"{len(batches)}ba")
    kwargs.setdefault("optimizer", functools.partial(DecoupledAdamW, lr=1e-2))
    callbacks = kwargs.pop("callbacks", [])
    return Trainer(
        model=tiny_model(),
        train_dataloader=batches,
        run_dir=tmp_path,
        callbacks=[*callbacks, *([saver] if saver else [])],
        **kwargs,
    )


def folders(path):
    return sorted(p.name for p in path.iterdir())


def test_saves_at_interval_and_end_with_latest_pointer(tmp_path):
    saver = CheckpointSaver(str(tmp_path / "ckpt"), save_interval="2ba")
    make_trainer(tmp_path, token_batches(5, 2), saver=saver).fit()
    assert folders(tmp_path / "ckpt") == ["ep0-ba2", "ep0-ba4", "ep1-ba5", "latest"]
    assert (tmp_path / "ckpt" / "latest").read_text() == "ep1-ba5\n"
    assert folders(tmp_path / "ckpt" / "ep1-ba5") == [
        "manifest.json",
        "model.safetensors",
        "rng-rank0.pt",
        "state.pt",
    ]


@pytest.mark.parametrize(
    ("interval", "expected"),
    [
        ("64tok", ["ep0-ba2", "ep1-ba4", "ep1-ba6"]),  # 32 tokens a batch, 3 batches an epoch
        ("6sp", ["ep0-ba3", "ep1-ba6"]),  # 2 samples per batch
        ("1ep", ["ep1-ba3", "ep2-ba6"]),  # at epoch ends, counted after the epoch rolls over
        ("0.5dur", ["ep0-ba3", "ep1-ba6"]),
    ],
)
def test_save_interval_in_any_unit(tmp_path, interval, expected):
    saver = CheckpointSaver(str(tmp_path / "ckpt"), save_interval=interval)
    make_trainer(tmp_path, token_batches(3, 2), saver=saver, max_duration="6ba").fit()
    assert [n for n in folders(tmp_path / "ckpt") if n != "latest"] == expected


def test_keeps_only_the_newest_checkpoints(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="llmfoundry")
    saver = CheckpointSaver(str(tmp_path / "ckpt"), save_interval="1ba", num_checkpoints_to_keep=2)
    make_trainer(tmp_path, token_batches(5, 2), saver=saver).fit()
    assert folders(tmp_path / "ckpt") == ["ep0-ba4", "ep0-ba5", "latest"]
    assert "deleted ep0-ba2" in caplog.text


def complete_checkpoint(path):
    """A checkpoint folder whose (empty) manifest makes it complete."""
    path.mkdir()
    (path / "manifest.json").write_bytes(manifest_bytes({}))


def test_prune_counts_back_from_latest(tmp_path):
    for name in ("ep0-ba1", "ep0-ba2", "ep1-ba3", "ep1-ba4"):
        complete_checkpoint(tmp_path / name)
    # ep1-ba4 is newer than latest: an abandoned future; left alone.
    (tmp_path / "latest").write_text("ep1-ba3\n")
    # Left by killed saves: a local staging folder, a temporary pointer, an upload cut short.
    (tmp_path / ".ep1-ba9.staging").mkdir()
    (tmp_path / "latest.tmp.123.abc").write_text("ep1-ba9\n")
    (tmp_path / "ep1-ba9").mkdir()
    assert catalogue.prune(str(tmp_path), keep=2) == ["ep0-ba1"]
    assert folders(tmp_path) == ["ep0-ba2", "ep1-ba3", "ep1-ba4", "latest"]
    assert catalogue.prune(str(tmp_path), keep=1) == ["ep0-ba2"]
    assert catalogue.prune(str(tmp_path), keep=-1) == []


def _lists(groups):
    return [{k: list(v) if isinstance(v, tuple) else v for k, v in g.items()} for g in groups]


def test_roundtrip_restores_every_part(tmp_path):
    """Train 3 batches and save; a fresh trainer loading it holds the same state."""
    rtr = RandomTokenReplacement(probability=0.2, vocab_size=64, seed=3)
    console = ConsoleLogger()
    console.load_state_dict({"eval_history": {"eval/x/loss": [1.5]}})
    trainer = make_trainer(
        tmp_path,
        token_batches(3, 2),
        saver=CheckpointSaver(str(tmp_path / "ckpt")),
        algorithms=[rtr],
        loggers=[console],
        scheduler=CosineWithWarmup(t_warmup="1ba"),
        config={"model": {"d_model": 32}},
    )
    trainer.fit()
    resumed = make_trainer(
        tmp_path,
        token_batches(3, 2),
        load_path=str(tmp_path / "ckpt"),
        algorithms=[RandomTokenReplacement(probability=0.2, vocab_size=64, seed=99)],
        loggers=[ConsoleLogger()],
        scheduler=CosineWithWarmup(t_warmup="1ba"),
    )
    a, b = trainer.state, resumed.state
    assert b.timestamp == a.timestamp and b.timestamp.batch == 3
    for (name, x), (_, y) in zip(
        a.model.state_dict().items(), b.model.state_dict().items(), strict=True
    ):
        assert torch.equal(x, y), name
    sa, sb = a.optimizer.state_dict(), b.optimizer.state_dict()
    # Loading by parameter name (torch.distributed.checkpoint) turns tuples (betas) into lists.
    assert _lists(sa["param_groups"]) == _lists(sb["param_groups"])
    for key in sa["state"]:
        for name, value in sa["state"][key].items():
            assert torch.equal(value, sb["state"][key][name]), (key, name)
    assert torch.equal(b.algorithms[0].generator.get_state(), rtr.generator.get_state())
    assert resumed.logger.destinations[0].state_dict() == {"eval_history": {"eval/x/loss": [1.5]}}
    assert read_checkpoint(str(tmp_path / "ckpt"), 0).state["config"] == {"model": {"d_model": 32}}


def test_data_position_is_saved_and_restored(tmp_path):
    saver = CheckpointSaver(str(tmp_path / "ckpt"))
    make_trainer(tmp_path, Batches(token_batches(4, 2)), saver=saver, max_duration="3ba").fit()
    assert read_checkpoint(str(tmp_path / "ckpt"), 0).state["data"] == {"sample_in_epoch": 6}
    loader = Batches(token_batches(4, 2))
    make_trainer(tmp_path, loader, load_path=str(tmp_path / "ckpt"))
    assert loader.skip == 3


def test_mid_epoch_checkpoint_needs_a_resumable_dataloader(tmp_path):
    saver = CheckpointSaver(str(tmp_path / "ckpt"))
    make_trainer(tmp_path, token_batches(4, 2), saver=saver, max_duration="3ba").fit()
    with pytest.raises(ValueError, match="3 batches into epoch 0.*load_ignore_keys"):
        make_trainer(tmp_path, token_batches(4, 2), load_path=str(tmp_path / "ckpt"))
    # Restarting the epoch's data is allowed when asked for.
    trainer = make_trainer(
        tmp_path, token_batches(4, 2), load_path=str(tmp_path / "ckpt"), load_ignore_keys=["data"]
    )
    assert trainer.state.timestamp.batch == 3


def test_weights_only_load_for_finetuning(tmp_path):
    saver = CheckpointSaver(str(tmp_path / "ckpt"))
    trained = make_trainer(tmp_path, token_batches(3, 2), saver=saver).fit()
    tuned = make_trainer(
        tmp_path,
        token_batches(3, 2),
        load_path=str(tmp_path / "ckpt" / "ep1-ba3"),
        load_ignore_keys=list(WEIGHTS_ONLY),
    )
    assert tuned.state.timestamp.batch == 0 and not tuned.state.optimizer.state
    for (name, x), (_, y) in zip(
        trained.model.state_dict().items(), tuned.state.model.state_dict().items(), strict=True
    ):
        assert torch.equal(x, y), name
    tuned.fit()  # trains from batch 0 with a fresh optimizer
    assert tuned.state.timestamp.batch == 3


def test_no_scheduler_slot_and_checkpoints_with_one_still_load(tmp_path, monkeypatch, caplog):
    def run(folder, **kwargs):
        saver = CheckpointSaver(str(tmp_path / folder))
        schedule = CosineWithWarmup(t_warmup="1ba")
        return make_trainer(
            tmp_path, token_batches(3, 2), saver=saver, scheduler=schedule, **kwargs
        )

    run("new").fit()
    assert "scheduler" not in read_checkpoint(str(tmp_path / "new"), 0).state
    # Checkpoints saved while the slot existed hold an empty "scheduler".
    original = state_dict.run_state
    with monkeypatch.context() as patch:
        patch.setattr(state_dict, "run_state", lambda *a: {**original(*a), "scheduler": {}})
        trained = run("old").fit()
    assert read_checkpoint(str(tmp_path / "old"), 0).state["scheduler"] == {}
    resumed = run("resumed", load_path=str(tmp_path / "old"))
    assert resumed.state.timestamp == trained.timestamp
    # `scheduler` in load_ignore_keys is dropped, with a warning once per process (a config is
    # checked before the run and again on load).
    keys._warn_removed.cache_clear()
    with caplog.at_level(logging.WARNING, logger="llmfoundry.checkpoint"):
        tuned = run(
            "tuned", load_path=str(tmp_path / "old"), load_ignore_keys=["scheduler", *WEIGHTS_ONLY]
        )
        assert check_ignore_keys(["scheduler", "optimizer"]) == ("optimizer",)
    assert tuned.state.timestamp.batch == 0
    assert caplog.text.count("load_ignore_keys: scheduler is no longer a part of checkpoints") == 1


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        (["optimiser"], r"unknown key\(s\) \['optimiser'\].*allowed: model, optimizer"),
        (["timestamp"], "has 'timestamp' but not 'data'"),
    ],
)
def test_bad_ignore_keys(tmp_path, keys, message):
    make_trainer(tmp_path, token_batches(1, 2), saver=CheckpointSaver(str(tmp_path / "c"))).fit()
    with pytest.raises(ValueError, match=message):
        make_trainer(
            tmp_path, token_batches(1, 2), load_path=str(tmp_path / "c"), load_ignore_keys=keys
        )


def test_load_path_errors_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither a checkpoint folder") as err:
        make_trainer(tmp_path, token_batches(1, 2), load_path=str(tmp_path / "nothing"))
    assert isinstance(err.value, UserError)  # scripts/train.py: one line, exit 2
    make_trainer(tmp_path, token_batches(1, 2), saver=CheckpointSaver(str(tmp_path / "c"))).fit()
    other = Trainer(
        model=tiny_model(vocab_size=80),
        train_dataloader=token_batches(1, 2),
        run_dir=tmp_path,
        max_duration="1ba",
        optimizer=functools.partial(DecoupledAdamW, lr=1e-2),
    )
    with pytest.raises(ValueError, match="weights do not fit this model"):
        other.load(str(tmp_path / "c"))


def test_latest_pointing_outside_the_folder_is_refused(tmp_path, caplog):
    (tmp_path / "latest").write_text("../../etc\n")
    with pytest.raises(ValueError, match="not a checkpoint name"):
        read_latest(str(tmp_path))
    # Resuming treats the pointer as a shortcut only: it scans instead, and finds nothing here.
    assert latest_checkpoint(str(tmp_path)) is None
    assert "not a checkpoint name" in caplog.text


class Evil:
    """Unpickling this would run code; weights_only loading must refuse it."""

    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_loading_never_unpickles_objects(tmp_path):
    make_trainer(tmp_path, token_batches(1, 2), saver=CheckpointSaver(str(tmp_path / "c"))).fit()
    folder = tmp_path / "c" / "ep1-ba1"
    torch.save({"format_version": 1, "x": Evil()}, folder / "state.pt")
    # Caught by the manifest first; with the manifest forged to match, by weights_only loading.
    with pytest.raises(ValueError, match="state.pt .*the manifest says"):
        read_checkpoint(str(folder), 0)
    entries = json.loads((folder / "manifest.json").read_text())["files"]
    entries["state.pt"] = hash_tree(folder)["state.pt"]
    (folder / "manifest.json").write_bytes(manifest_bytes(entries))
    with pytest.raises(ValueError, match="cannot read .*state.pt"):
        read_checkpoint(str(tmp_path / "c"), 0)


def test_rng_state_survives_weights_only_save(tmp_path):
    torch.manual_seed(1)
    np.random.seed(2)
    state = rng_state(torch.device("cpu"))
    torch.save(state, tmp_path / "rng.pt")
    expected = (torch.rand(3), np.random.rand(3), __import__("random").random())
    torch.manual_seed(5)
    np.random.seed(5)
    load_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True), torch.device("cpu"))
    assert torch.equal(torch.rand(3), expected[0])
    assert np.array_equal(np.random.rand(3), expected[1])
    assert __import__("random").random() == expected[2]


class FailOnce:
    """Make writing one file of a checkpoint fail, as a crash mid-save would."""

    def __init__(self, monkeypatch, filename, at_save):
        self.calls = 0
        original = writer.write_checkpoint

        def write(folder, name, files):
            self.calls += 1
            if self.calls == at_save:
                files = dict(files)

                def boom(path):
                    path.write_bytes(b"half a file")
                    raise OSError("disk full (injected)")

                files[filename] = boom
            return original(folder, name, files)

        monkeypatch.setattr("llmfoundry.checkpoint.state_dict.write_checkpoint", write)


@pytest.mark.parametrize("folder", ["local", "memory"])
def test_failed_save_leaves_latest_at_the_previous_checkpoint(tmp_path, monkeypatch, folder):
    url = str(tmp_path / "ckpt") if folder == "local" else f"memory://ckpt-{uuid.uuid4().hex}"
    FailOnce(monkeypatch, "state.pt", at_save=2)
    saver = CheckpointSaver(url, save_interval="1ba")
    with pytest.raises(OSError, match="injected"):
        make_trainer(tmp_path, Batches(token_batches(3, 2)), saver=saver).fit()
    assert read_latest(url) == "ep0-ba1"
    fs, root = fsspec.core.url_to_fs(url)
    names = sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(root, detail=False))
    # Nothing of the failed save is left: files are uploaded (or moved) only once all are written.
    assert names == ["ep0-ba1", "latest"]
    # Resuming continues from ep0-ba1; its saves replace and clear what the failure left.
    saver = CheckpointSaver(url, save_interval="1ba", num_checkpoints_to_keep=1)
    resumed = make_trainer(tmp_path, Batches(token_batches(3, 2)), saver=saver, load_path=url)
    assert resumed.state.timestamp.batch == 1
    resumed.fit()
    names = sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(root, detail=False))
    assert names == ["ep0-ba3", "latest"]


def test_memory_filesystem_roundtrip(tmp_path):
    url = f"memory://runs/{uuid.uuid4().hex}/ckpt"
    saver = CheckpointSaver(url, save_interval="2ba", num_checkpoints_to_keep=1)
    trainer = make_trainer(tmp_path, token_batches(4, 2), saver=saver)
    trainer.fit()
    assert saver.last_saved == f"{url}/ep0-ba4"
    assert latest_checkpoint(url) == f"{url}/ep0-ba4"
    fs, root = fsspec.core.url_to_fs(url)
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)) == ["ep0-ba4", "latest"]
    resumed = make_trainer(tmp_path, token_batches(4, 2), load_path=url, load_ignore_keys=["data"])
    assert resumed.state.timestamp.batch == 4
    for (name, x), (_, y) in zip(
        trainer.state.model.state_dict().items(),
        resumed.state.model.state_dict().items(),
        strict=True,
    ):
        assert torch.equal(x, y), name


def test_load_fires_before_and_after_load(tmp_path):
    make_trainer(tmp_path, token_batches(2, 2), saver=CheckpointSaver(str(tmp_path / "c"))).fit()
    seen = []

    class Events(Callback):
        def run_event(self, event, state, logger):
            seen.append((event.value, state.timestamp.batch))

    trainer = make_trainer(
        tmp_path,
        token_batches(2, 2),
        callbacks=[Events()],
        load_path=str(tmp_path / "c"),
        max_duration="3ba",
    )
    assert seen == [("init", 0), ("before_load", 0), ("after_load", 2)]
    trainer.fit()
    assert seen[3] == ("fit_start", 2)


def test_resuming_a_finished_run_does_not_save_again(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="llmfoundry")
    make_trainer(tmp_path, token_batches(2, 2), saver=CheckpointSaver(str(tmp_path / "c"))).fit()
    caplog.clear()
    saver = CheckpointSaver(str(tmp_path / "c"))
    state = make_trainer(
        tmp_path, token_batches(2, 2), saver=saver, load_path=str(tmp_path / "c")
    ).fit()
    assert state.timestamp.batch == 2 and saver.last_saved is None
    assert "saved checkpoint" not in caplog.text


def test_stop_training_saves_at_the_stopping_batch(tmp_path):
    class StopAt(Callback):
        def batch_end(self, state, logger):
            state.stop_training = state.timestamp.batch == 2

    make_trainer(
        tmp_path,
        token_batches(4, 2),
        callbacks=[StopAt()],
        saver=CheckpointSaver(str(tmp_path / "c"), save_interval="10ba"),
    ).fit()
    assert read_latest(str(tmp_path / "c")) == "ep0-ba2"


def test_sigterm_saves_after_the_current_batch_and_stops(tmp_path):
    events = []

    class SignalAt(Callback):
        def before_forward(self, state, logger):
            if state.timestamp.batch == 2:  # mid-batch, as a scheduler's signal would come
                os.kill(os.getpid(), signal.SIGTERM)

        def fit_end(self, state, logger):
            events.append("fit_end")

    before = signal.getsignal(signal.SIGTERM)
    saver = CheckpointSaver(str(tmp_path / "c"))
    state = make_trainer(
        tmp_path,
        token_batches(6, 2),
        callbacks=[SignalAt()],
        saver=saver,
        eval_dataloaders={"v": token_batches(1, 2)},
    ).fit()
    assert state.timestamp.batch == 3 and state.stop_training
    assert read_latest(str(tmp_path / "c")) == "ep0-ba3"
    assert events == []  # preempted runs are unfinished: no final evaluation, no FIT_END
    assert signal.getsignal(signal.SIGTERM) is before

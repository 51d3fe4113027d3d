"""The contents of a checkpoint: everything needed to continue a run exactly, and how it returns.

A checkpoint holds, under these keys (any of which `load_ignore_keys` may skip on load):

- ``model``: the weights (model.safetensors; in ``sharded/`` with a sharding strategy);
- ``optimizer`` (keyed by parameter name, so it loads into any strategy; in ``sharded/`` with a
  sharding strategy), ``scaler`` (the amp_fp16 loss scaler); the learning-rate schedule has no
  state to save: it is a pure function of ``timestamp``;
- ``timestamp``: epochs, batches, samples, tokens, in total and within the epoch;
- ``algorithms``, ``callbacks``, ``loggers``: each object's ``state_dict()``, keyed by class name
  (``Name``, ``Name#1`` for a second one), so adding or removing one between runs is harmless;
- ``data``: the train dataloader's position, ``state_dict(timestamp.sample_in_epoch)``;
- ``rng``: each rank's python, numpy, torch (and CUDA) generator states, one file per rank;
- ``config``: the run's config; never loaded, but compared with the loading run's (compat.py).

Model and optimizer state are read and written as the strategy holds them (state.py for full
checkpoints, sharded.py for shards), so a checkpoint saved by one strategy loads into any
other, at any world size.

Finetuning from pretrained weights: ``load_ignore_keys=[optimizer, scaler, timestamp, algorithms,
callbacks, loggers, data, rng]`` (`WEIGHTS_ONLY`). Checkpoints saved before the ``scheduler``
slot was removed (an always-empty dict) load as they are; ``scheduler`` in `load_ignore_keys`
is accepted with a warning (`check_ignore_keys`).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from typing import Any

import torch

from llmfoundry.checkpoint.catalogue import (
    MODEL_FILE,
    SHARDED_DIR,
    STATE_FILE,
    checkpoint_name,
    rng_file,
)
from llmfoundry.checkpoint.compat import check_resume, keep_hyperparameters
from llmfoundry.checkpoint.finite import refuse_non_finite
from llmfoundry.checkpoint.formats import read_run_together
from llmfoundry.checkpoint.keys import (
    FORMAT_VERSION,
    LOADABLE_KEYS,
    WEIGHTS_ONLY,
    check_ignore_keys,
)
from llmfoundry.checkpoint.loaded import Checkpoint
from llmfoundry.checkpoint.manifest import CheckpointError
from llmfoundry.checkpoint.sharded import (
    SHARDED_KEYS,
    fit_layout,
    load_shards,
    shard_targets,
    split_shards,
    write_shards,
)
from llmfoundry.checkpoint.state import (
    load_model_state_dict,
    load_optimizer_state_dict,
    local_weights,
    model_state_dict,
    optimizer_state_dict,
)
from llmfoundry.checkpoint.writer import (
    PendingCheckpoint,
    begin_checkpoint,
    write_checkpoint,
    write_object,
    write_tensors,
)
from llmfoundry.core.engine import Logger
from llmfoundry.core.state import State
from llmfoundry.rng import rng_state
from llmfoundry.utils.errors import UserError
from llmfoundry.utils.files import FileWriter, join_url

log = logging.getLogger(__name__)

# Each object's state_dict() by name (`_objects`); in a sharded checkpoint their DTensors
# (state laid out like the parameters, e.g. EMA's averages) are in the shards (split_shards).
OBJECT_KEYS = ("algorithms", "callbacks", "loggers")


def save_checkpoint(folder: str, state: State, logger: Logger) -> str:
    """Save `state` as ``<folder>/ep<epoch>-ba<batch>`` and point `latest` at it; return its URL.

    Called by every rank (each writes its RNG states, and its shards with a sharding strategy).
    """
    name = checkpoint_name(state.timestamp.epoch, state.timestamp.batch)
    return write_checkpoint(folder, name, checkpoint_files(state, logger))


def begin_save(folder: str, state: State, logger: Logger) -> PendingCheckpoint:
    """`save_checkpoint` whose shards the strategy may go on writing in the background
    (``strategy.async_save``): everything is taken from `state` now, and nothing counts (no
    manifest, `latest` unchanged) until every rank calls `finish()` on the result."""
    name = checkpoint_name(state.timestamp.epoch, state.timestamp.batch)
    return begin_checkpoint(folder, name, checkpoint_files(state, logger))


def load_checkpoint(
    path: str, state: State, logger: Logger, ignore_keys: Sequence[str] = ()
) -> dict[str, Any] | None:
    """Load the checkpoint at `path` (a checkpoint or a save folder, or another program's
    checkpoint: formats.py) into `state`; see `restore`. Every rank calls it (a damaged file
    fails them all: `read_run_together`)."""
    return restore(state, logger, read_run_together(path, state.rank), ignore_keys)


def checkpoint_files(state: State, logger: Logger) -> dict[str, FileWriter]:
    """The files this rank writes for a checkpoint of `state` (rank 0 the shared ones).

    Gathering whole weights and optimizer state is a collective under a sharding strategy, so
    every rank gathers them even though only rank 0 writes them. First the ranks
    agree that the weights are finite (else every rank raises, before anything is written).
    """
    strategy = state.strategy
    refuse_non_finite(
        f"checkpoint {checkpoint_name(state.timestamp.epoch, state.timestamp.batch)}",
        local_weights(strategy, state.model),
        strategy.all_reduce_sum,
        strategy.device,
    )
    files: dict[str, FileWriter] = {rng_file(state.rank): write_object(rng_state(state.device))}
    run = run_state(state, logger)
    if strategy.sharded_checkpoints:
        objects = {}
        for key in OBJECT_KEYS:
            run[key], shards = split_shards(run[key])
            if shards:
                objects[key] = shards
        files[SHARDED_DIR] = write_shards(strategy, state.model, state.optimizer, objects)
    else:
        weights = model_weights(model_state_dict(state.model))
        run["optimizer"] = optimizer_state_dict(state.model, state.optimizer)
    if state.rank == 0:
        if not strategy.sharded_checkpoints:
            files[MODEL_FILE] = write_tensors(weights)
        files[STATE_FILE] = write_object(run)
    return files


def model_weights(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A model state dict as contiguous CPU tensors, with tied (shared) tensors copied.

    safetensors refuses tensors that share memory; loading fills each name, so a tied pair
    comes back tied (both names point at the same parameter in the model).
    """
    weights, seen = {}, set()
    for name, tensor in state_dict.items():
        tensor = tensor.detach().to("cpu").contiguous()
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        weights[name] = tensor.clone() if key in seen else tensor
        seen.add(key)
    return weights


def run_state(state: State, logger: Logger) -> dict[str, Any]:
    """Everything but the weights, the optimizer and the RNG, as tensors and plain containers
    (`checkpoint_files` adds the optimizer to full checkpoints)."""
    return {
        "format_version": FORMAT_VERSION,
        "scaler": _state_of(state.precision),
        "timestamp": state.timestamp.state_dict(),
        **{key: _by_name(objects) for key, objects in _objects(state, logger).items()},
        "data": _data_state(state),
        "config": state.config,
    }


def restore(
    state: State, logger: Logger, checkpoint: Checkpoint, ignore_keys: Sequence[str] = ()
) -> dict[str, Any] | None:
    """Load `checkpoint` into `state` except `ignore_keys`; return the RNG states to restore.

    The RNG is returned rather than applied: the trainer restores it at the point of the loop
    where it was saved (see `Trainer.load`).
    """
    ignore = set(check_ignore_keys(ignore_keys))
    saved, where = checkpoint.state, checkpoint.path
    if saved.get("format_version") != FORMAT_VERSION:
        raise UserError(
            f"checkpoint {where!r} has format_version {saved.get('format_version')!r}; this "
            f"version of llmfoundry reads format {FORMAT_VERSION}"
        )
    recorded = saved.get("config") or {}
    # Another program's run records less than ours: compared only where it recorded.
    now = state.config if checkpoint.origin is None else _within(state.config, recorded)
    check_resume(recorded, now, ignore, where)
    strategy = state.strategy
    current = {key: _by_name(objects) for key, objects in _objects(state, logger).items()}
    in_shards = {}  # the objects' tensors that DCP fills in place (`shard_targets`)
    if checkpoint.model is None:  # sharded: model and optimizer come from its shards
        keys = [k for k in SHARDED_KEYS if k not in ignore]
        for key in OBJECT_KEYS:
            if key not in ignore and (targets := shard_targets(saved.get(key), current[key])):
                in_shards[key] = targets
        # A changed optimizer config applies, as for a whole checkpoint's optimizer below.
        keep = keep_hyperparameters(state.optimizer) if "optimizer" in keys else nullcontext()
        try:
            with keep:
                load_shards(
                    strategy,
                    join_url(where, SHARDED_DIR),
                    state.model,
                    state.optimizer,
                    keys,
                    in_shards,
                )
        except CheckpointError:  # a shard that is damaged or refused: already names its file
            raise
        except (RuntimeError, ValueError, KeyError) as err:
            raise UserError(
                f"checkpoint {where!r}: its shards do not fit this model and optimizer "
                f"({str(err)[:300]}); load it into the same model config and optimizer, or add "
                "'optimizer' to load_ignore_keys"
            ) from None
        ignore |= set(SHARDED_KEYS)
    absent = [k for k in LOADABLE_KEYS if k not in ("model", "rng", *ignore) and k not in saved]
    if absent:
        raise UserError(
            f"checkpoint {where!r} has no {', '.join(absent)} (it holds weights only, e.g. from "
            f"scripts/import_hf.py); load just its weights with load_ignore_keys=["
            f"{', '.join(WEIGHTS_ONLY)}]"
        )
    if "model" not in ignore:
        try:
            load_model_state_dict(strategy, state.model, checkpoint.model)
        except (RuntimeError, KeyError) as err:
            raise UserError(
                f"checkpoint {where!r}: its weights do not fit this model ({err}); load it "
                "into the same model config"
            ) from None
    if "optimizer" not in ignore:
        try:
            with keep_hyperparameters(state.optimizer):  # a changed optimizer config applies
                load_optimizer_state_dict(
                    strategy, state.model, state.optimizer, _with_groups(state, saved["optimizer"])
                )
        except (ValueError, KeyError, RuntimeError) as err:
            raise UserError(
                f"checkpoint {where!r}: its optimizer state does not fit this optimizer ({err}); "
                "add 'optimizer' to load_ignore_keys to start the optimizer afresh"
            ) from None
    if "scaler" not in ignore and saved["scaler"] and state.precision is not None:
        state.precision.load_state_dict(saved["scaler"])
    if "timestamp" not in ignore:
        state.timestamp.load_state_dict(saved["timestamp"])
        if checkpoint.not_carried:
            log.warning("%s", checkpoint.not_carried)
        if (
            checkpoint.origin == "Composer"
            and getattr(state.scheduler, "composer_lag", True) is False
        ):
            log.warning(
                "checkpoint %r is Composer's: this run's lr schedule steps one batch ahead of "
                "Composer's; set scheduler.composer_lag=true to continue its lr curve exactly",
                where,
            )
    for key, objects in _objects(state, logger).items():
        if key not in ignore:
            _load_by_name(objects, fit_layout(saved[key], current[key], in_shards.get(key, {})))
    if "data" not in ignore:
        _load_data_state(state, saved["data"], where, checkpoint.origin)
    if "rng" in ignore:
        return None
    if checkpoint.rng is None:
        log.warning("checkpoint %r has no RNG state for this rank; keeping the seeded one", where)
    return checkpoint.rng


def _within(config: Any, recorded: Any) -> Any:
    """`config` with only the keys `recorded` has, at every depth."""
    if not (isinstance(config, Mapping) and isinstance(recorded, Mapping)):
        return config
    return {k: _within(v, recorded[k]) for k, v in config.items() if k in recorded}


def _with_groups(state: State, optimizer: dict[str, Any]) -> dict[str, Any]:
    """`optimizer` (saved state) with this run's parameter groups where it has none: another
    program's per-parameter state, whose groups (hyperparameters) are this run's config."""
    if "param_groups" in optimizer:
        return optimizer
    current = optimizer_state_dict(state.model, state.optimizer)
    return {**optimizer, "param_groups": current["param_groups"]}


def _objects(state: State, logger: Logger) -> dict[str, Sequence[Any]]:
    """The objects whose state checkpoints keep by name, under their OBJECT_KEYS."""
    objects = (state.algorithms, state.callbacks, logger.destinations)
    return dict(zip(OBJECT_KEYS, objects, strict=True))


def _state_of(obj: Any) -> dict[str, Any]:
    state_dict = getattr(obj, "state_dict", None)
    return state_dict() if callable(state_dict) else {}


def _names(objects: Sequence[Any]) -> list[str]:
    counts: Counter[str] = Counter()
    names = []
    for obj in objects:
        name = type(obj).__name__
        names.append(f"{name}#{counts[name]}" if counts[name] else name)
        counts[name] += 1
    return names


def _by_name(objects: Sequence[Any]) -> dict[str, Any]:
    return {name: obj.state_dict() for name, obj in zip(_names(objects), objects, strict=True)}


def _load_by_name(objects: Sequence[Any], saved: dict[str, Any]) -> None:
    for name, obj in zip(_names(objects), objects, strict=True):
        if name in saved:
            obj.load_state_dict(saved[name])


def data_source(dataloader: Any) -> Any:
    """What holds the data position: the loader or its dataset, whichever has the state API."""
    for obj in (dataloader, getattr(dataloader, "dataset", None)):
        if callable(getattr(obj, "state_dict", None)) and callable(
            getattr(obj, "load_state_dict", None)
        ):
            return obj
    return None


def _data_state(state: State) -> dict[str, Any] | None:
    source = data_source(state.train_dataloader)
    return None if source is None else source.state_dict(int(state.timestamp.sample_in_epoch))


def _load_data_state(
    state: State, saved: dict[str, Any] | None, where: str, origin: str | None = None
) -> None:
    source = data_source(state.train_dataloader)
    if source is not None and saved is not None:
        if origin is not None:  # another program's position: this loader's state at that sample
            saved = {**source.state_dict(saved["sample_in_epoch"]), "epoch": saved["epoch"]}
        source.load_state_dict(saved)
        return
    if state.timestamp.sample_in_epoch == 0:
        return  # at an epoch boundary the epoch number alone is the position
    why = (
        "the run that saved it could not record its data position"
        if saved is None
        else "this run's train dataloader has no state_dict/load_state_dict"
    )
    raise UserError(
        f"checkpoint {where!r} was taken {state.timestamp.batch_in_epoch} batches into epoch "
        f"{state.timestamp.epoch}, but {why}, so resuming would repeat or skip samples. Use a "
        "dataloader whose dataset has state_dict(num_samples)/load_state_dict (like "
        "llmfoundry.data.build_loaders), or add 'data' to load_ignore_keys to restart the "
        "epoch's data from its beginning"
    )

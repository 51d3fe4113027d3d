"""Assemble a Trainer from a composed, validated Hydra config.

This is the one place that knows how config groups become objects; `scripts/train.py` and the
tests both go through it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import torch
from hydra.utils import get_class, instantiate
from omegaconf import DictConfig, OmegaConf
from torch import nn

from llmfoundry.callbacks import CheckpointSaver
from llmfoundry.checkpoint import CheckpointError, latest_checkpoint, locate, newest_damage
from llmfoundry.checkpoint.lock import lock_run_folders
from llmfoundry.config import TrainSettings, validate_config
from llmfoundry.core.metrics import LanguageMetrics
from llmfoundry.core.precision import resolve_auto
from llmfoundry.data import build_loaders
from llmfoundry.data.meta import bytes_per_token
from llmfoundry.data.streaming import StreamingDataLoader
from llmfoundry.data.text import check_vocab
from llmfoundry.models.converters import ConversionContext, convert_model, resolve_precision
from llmfoundry.models.custom import set_fsdp_blocks
from llmfoundry.models.families import build_model
from llmfoundry.trainer import EvalSet, Trainer
from llmfoundry.utils import storage
from llmfoundry.utils.errors import UserError


def build_trainer(
    cfg: DictConfig, run_dir: str | Path, write_run_files: Callable[[], object] | None = None
) -> Trainer:
    """The run's Trainer; ``write_run_files`` (scripts/train.py's saved config) runs on rank 0
    once the run folder is locked, so a launch refused because another run holds the folder
    leaves that run's files as they are."""
    settings = validate_config(cfg)
    # First: everything below (data, tokenizer, checkpoints, load_path) may open remote URLs.
    storage.configure_settings(settings.storage)
    strategy = instantiate(cfg.strategy)
    # Before anything is built: the save folder takes writes, no other run uses these folders.
    locks = lock_run_folders(str(run_dir), settings.save_folder) if strategy.rank == 0 else []
    if locks and write_run_files is not None:
        write_run_files()
    # autoresume: the run's own newest complete checkpoint wins over load_path (which then
    # only seeds the first launch, e.g. with pretrained weights). A load_path that does not
    # open fails here, before the model and data are built.
    load_path, load_ignore_keys = settings.load_path, settings.load_ignore_keys
    if settings.autoresume and (latest := latest_checkpoint(settings.save_folder)):
        load_path, load_ignore_keys = latest, []
    elif settings.autoresume and (damage := newest_damage(settings.save_folder)):
        raise CheckpointError(
            f"autoresume: save_folder {settings.save_folder} holds no complete checkpoint to "
            f"continue from: {damage}; copy that checkpoint again if it came from elsewhere, "
            "or delete it to start the run afresh"
        )
    elif load_path:
        load_path = locate(load_path).location  # resolved once: the trainer reads this
    device_batch = per_rank_batch(settings.global_train_batch_size, strategy.dp_size)
    if strategy.pipeline is not None and settings.device_train_microbatch_size != "auto":
        strategy.pipeline.microbatches(device_batch, settings.device_train_microbatch_size)
    # Each data-parallel rank reads its own partition; the strategy (its device mesh) says which.
    data_parallel = (strategy.dp_rank, strategy.dp_size)
    if "fsdp_blocks" in cfg.model:  # conf/model/custom.yaml: your own module
        model = build_user_model(cfg.model, settings.seed)
        vocab_size = getattr(model, "vocab_size", None)
        seq_len = settings.max_seq_len or getattr(model, "max_seq_len", None)
        if not seq_len:
            raise UserError(
                f"{type(model).__name__} has no max_seq_len attribute; set max_seq_len=<tokens "
                "per training row>"
            )
    else:
        model_config = instantiate(cfg.model)
        vocab_size = model_config.vocab_size
        seq_len = settings.max_seq_len or model_config.max_seq_len
        # Built without memory; the strategy materializes it and initializes it from `seed`.
        # The config's class (its _target_) names the family: conf/model/mpt-* or llama*.
        model = build_model(model_config, init_device="meta")
    # The converters group (low-precision LayerNorm, float8, ...) swaps modules before the
    # strategy materializes and wraps the model, so sharding and the optimizer see the converted
    # ones. precision=amp_fp8 is bf16 autocast and the float8 converter (`resolve_precision`);
    # precision=auto is what the strategy's device trains in (`resolve_auto`), decided here for
    # the converters and the trainer alike.
    converters = {name: instantiate(node) for name, node in (cfg.get("converters") or {}).items()}
    precision = resolve_auto(settings.precision, strategy.device)
    precision, converters = resolve_precision(precision, converters)
    model = convert_model(model, converters, ConversionContext(precision, strategy.device))

    data = build_loaders(
        cfg.data,
        batch_size=device_batch,
        eval_batch_size=settings.device_eval_batch_size or device_batch,
        max_seq_len=seq_len,
        data_parallel=data_parallel,
        # Sequence parallelism splits each sequence over tp ranks, context parallelism into
        # 2 x cp chunks (and each chunk over tp when both).
        pad_to_multiple_of=strategy.tp * (2 * strategy.cp if strategy.cp > 1 else 1),
    )
    # Every dataset's ids must fit the embedding, eval sets' too; each meta.json checked once.
    datasets = [data.train_dataset, *(loader.streaming_dataset for loader in data.evals.values())]
    for dataset in {d.meta_url: d for d in datasets}.values():
        if vocab_size is not None:  # a module of your own may not say
            check_vocab(dataset.meta, vocab_size, dataset.meta_url)

    def instantiate_all(group: str) -> list:
        nodes = cfg.get(group) or {}
        return [instantiate(node) for node in nodes.values()]

    callbacks = instantiate_all("callbacks")
    if settings.save_folder:
        # First, after the locks: its refusal to write over another run's checkpoints comes
        # before anything of this run starts (run_status would mark that run failed).
        callbacks.insert(
            0,
            CheckpointSaver(
                settings.save_folder,
                settings.save_interval,
                settings.num_checkpoints_to_keep,
                overwrite=settings.save_overwrite,
            ),
        )

    return Trainer(
        model=model,
        strategy=strategy,
        train_dataloader=data.train,
        eval_dataloaders={label: language_eval_set(loader) for label, loader in data.evals.items()},
        max_duration=settings.max_duration,
        optimizer=instantiate(cfg.optimizer),
        scheduler=instantiate(cfg.scheduler) if cfg.get("scheduler") else None,
        run_dir=run_dir,
        eval_interval=settings.eval_interval,
        eval_first=settings.eval_first,
        eval_subset_num_batches=settings.eval_subset_num_batches,
        algorithms=instantiate_all("algorithms"),
        callbacks=[*locks, *callbacks],
        loggers=instantiate_all("loggers"),
        precision=precision,
        device_train_microbatch_size=settings.device_train_microbatch_size,
        device_eval_microbatch_size=eval_microbatch_size(settings, device_batch),
        seed=settings.seed,
        config=OmegaConf.to_container(cfg, resolve=True),
        load_path=load_path,
        load_ignore_keys=load_ignore_keys,
    )


def build_user_model(node: DictConfig, seed: int) -> nn.Module:
    """Your own module (conf/model/custom.yaml): its builder (``_target_``) called with the
    node's other keys, under `seed` so that every rank builds the same weights (FSDP shards
    them as they are), and its ``fsdp_blocks`` classes recorded (llmfoundry/models/custom.py)."""
    fields = OmegaConf.to_container(node, resolve=True)
    blocks = tuple(_block_class(name) for name in fields.pop("fsdp_blocks") or [])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = instantiate(fields)
    if not isinstance(model, nn.Module):
        raise UserError(
            f"model._target_ {fields['_target_']} returned a {type(model).__name__}, not an "
            "nn.Module with forward(batch) and loss(outputs, batch) (llmfoundry/core/model.py)"
        )
    set_fsdp_blocks(model, blocks)
    return model


def _block_class(name: str) -> type:
    try:
        return get_class(name)
    except Exception:  # Hydra's lookup raises ImportError, ValueError or its own errors
        raise UserError(
            f"model.fsdp_blocks: cannot import the class {name!r}; name it as module.Class"
        ) from None


def eval_microbatch_size(settings: TrainSettings, device_batch: int) -> int:
    """Samples per eval forward: `device_eval_microbatch_size`, else the train microbatch when
    it is a number, else the per-device train batch (auto-microbatching's first try). Whatever
    fits a training step fits an eval forward, which keeps no activations or gradients; the eval
    loaders' batch (`device_eval_batch_size`, 32 by default) may not: its logits alone are
    6.6 GB in bf16 at 32 x 2048 x 50k."""
    if settings.device_eval_microbatch_size is not None:
        return settings.device_eval_microbatch_size
    train = settings.device_train_microbatch_size
    return train if isinstance(train, int) else device_batch


def per_rank_batch(global_batch: int, dp_size: int) -> int:
    """Samples per data-parallel rank; a global batch `dp_size` does not divide is refused
    (before any model is built) with the nearest sizes that work."""
    if global_batch % dp_size == 0:
        return global_batch // dp_size
    below, above = global_batch // dp_size * dp_size, (global_batch // dp_size + 1) * dp_size
    nearest = " or ".join(str(n) for n in (below, above) if n > 0)
    raise UserError(
        f"global_train_batch_size={global_batch} is not divisible by the {dp_size} data-parallel "
        f"ranks; use {nearest}"
    )


def language_eval_set(loader: StreamingDataLoader) -> EvalSet:
    """An eval loader scored by `LanguageMetrics`, with bits per byte where the split's meta.json
    records its text bytes (data_prep/tokens_to_mds.py does)."""
    dataset = loader.streaming_dataset
    per_token = bytes_per_token(dataset.meta or {}, dataset.split)
    return EvalSet(loader, functools.partial(LanguageMetrics, bytes_per_token=per_token))

"""Assemble a Trainer from a composed, validated Hydra config.

This is the one place that knows how config groups become objects; `scripts/train.py` and the
tests both go through it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from llmfoundry.callbacks import CheckpointSaver
from llmfoundry.checkpoint import latest_checkpoint, resolve
from llmfoundry.checkpoint.lock import lock_run_folders
from llmfoundry.config import validate_config
from llmfoundry.data import build_dataloader, build_eval_dataloaders
from llmfoundry.models.mpt import MPTForCausalLM
from llmfoundry.trainer import Trainer


def build_trainer(cfg: DictConfig, run_dir: str | Path) -> Trainer:
    settings = validate_config(cfg)
    strategy = instantiate(cfg.strategy)
    # Before anything is built: the save folder takes writes, no other run uses these folders.
    locks = lock_run_folders(str(run_dir), settings.save_folder) if strategy.rank == 0 else []
    # autoresume: the run's own newest complete checkpoint wins over load_path (which then
    # only seeds the first launch, e.g. with pretrained weights). A load_path that does not
    # open fails here, before the model and data are built.
    load_path, load_ignore_keys = settings.load_path, settings.load_ignore_keys
    if settings.autoresume and (latest := latest_checkpoint(settings.save_folder)):
        load_path, load_ignore_keys = latest, []
    elif load_path:
        resolve(load_path)
    if settings.global_train_batch_size % strategy.world_size:
        raise ValueError(
            f"global_train_batch_size={settings.global_train_batch_size} is not divisible by the "
            f"{strategy.world_size} training processes"
        )
    device_batch = settings.global_train_batch_size // strategy.world_size
    model_config = instantiate(cfg.model)
    seq_len = settings.max_seq_len or model_config.max_seq_len
    # Built without memory; the strategy materializes it and initializes it from `seed`.
    model = MPTForCausalLM(dataclasses.replace(model_config, init_device="meta"))

    data = instantiate(cfg.data)
    train_loader = build_dataloader(data, data.train_split, device_batch, seq_len)
    eval_batch = settings.device_eval_batch_size or device_batch
    eval_loaders = build_eval_dataloaders(data, eval_batch, seq_len)

    def instantiate_all(group: str) -> list:
        nodes = cfg.get(group) or {}
        return [instantiate(node) for node in nodes.values()]

    callbacks = instantiate_all("callbacks")
    if settings.save_folder:
        callbacks.append(
            CheckpointSaver(
                settings.save_folder,
                settings.save_interval,
                settings.num_checkpoints_to_keep,
                overwrite=settings.save_overwrite,
            )
        )

    return Trainer(
        model=model,
        strategy=strategy,
        train_dataloader=train_loader,
        eval_dataloaders=eval_loaders,
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
        precision=settings.precision,
        device_train_microbatch_size=settings.device_train_microbatch_size,
        seed=settings.seed,
        config=OmegaConf.to_container(cfg, resolve=True),
        load_path=load_path,
        load_ignore_keys=load_ignore_keys,
    )

"""Validate a whole composed training config (per-node rules from `_target_` signatures: schema.py)."""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from llmfoundry.config.parallelism import KEY as PARALLELISM
from llmfoundry.config.parallelism import parallelism_of, resolve_aliases, strategy_name
from llmfoundry.config.run_name import check_run_name, default_run_name
from llmfoundry.config.schema import (
    ConfigError,
    check_keys,
    check_type,
    validate_node,
    validate_targets,
)
from llmfoundry.config.settings import GROUPS, TrainSettings
from llmfoundry.config.static_schema import static_fields, static_schema
from llmfoundry.utils.errors import UserError


def register_resolvers() -> None:
    """`${run_id:}` in train.yaml: the run name every rank agrees on; `${checkpoint_model:}`
    in conf/model/from_checkpoint.yaml: the model config load_path's checkpoint recorded."""
    if not OmegaConf.has_resolver("run_id"):
        OmegaConf.register_new_resolver("run_id", default_run_name, use_cache=True)
    if not OmegaConf.has_resolver("checkpoint_model"):
        OmegaConf.register_new_resolver("checkpoint_model", _checkpoint_model, use_cache=True)


def _checkpoint_model(load_path: str | None) -> dict[str, Any]:
    """`recorded_model`, imported when a config uses it: a config is checked before torch
    loads (its errors answer in a second)."""
    from llmfoundry.checkpoint.pretrained import recorded_model

    return recorded_model(load_path)


def settings_from(cfg: DictConfig) -> TrainSettings:
    fields = {f.name for f in dataclasses.fields(TrainSettings)}
    values = {k: cfg[k] for k in cfg.keys() if k in fields}
    return TrainSettings(**values)


def validate_config(cfg: DictConfig) -> TrainSettings:
    """Raise ConfigError for the first problem found; return the top-level settings.

    The strategy group's old mesh keys (`strategy.tp`, ...) are moved into `parallelism:` in
    place first (`resolve_aliases`; build.py logs its notices)."""
    resolve_aliases(cfg)
    try:
        OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as err:
        raise ConfigError(getattr(err, "full_key", "") or "", str(err).splitlines()[0]) from None
    hints = typing.get_type_hints(TrainSettings)
    allowed = [*hints, *GROUPS, PARALLELISM, "hydra"]
    check_keys("", [str(k) for k in cfg.keys()], allowed)
    for key, annotation in hints.items():
        if key in cfg:
            check_type(key, cfg[key], annotation)
    try:
        settings = settings_from(cfg)
    except TypeError as err:
        raise ConfigError("", str(err)) from None
    except ValueError as err:
        key, _, message = str(err).partition(": ")
        raise ConfigError(key if message else "", message or str(err)) from None
    check_run_name(settings.run_name)  # before Hydra makes outputs/<run_name>
    # First from the targets' source, so that an error in any group is reported before the
    # targets (and torch) are imported; then each node against its imported target.
    data_hints = _static_data_hints()
    for group in GROUPS:
        if group in cfg and cfg[group] is not None and (group != "data" or data_hints):
            hints = data_hints if group == "data" else _user_model_hints(cfg, group)
            _validate_group(cfg, group, hints, static=True)
    for group in GROUPS:
        if group in cfg and cfg[group] is not None:
            # The data group's node also holds the keys its builder reads (splits, loader).
            hints = _data_builder().group_hints() if group == "data" else None
            _validate_group(cfg, group, hints or _user_model_hints(cfg, group), static=False)
    if isinstance(cfg.get("data"), DictConfig):
        try:
            splits = _data_builder().splits_of(cfg.data)
        except UserError as err:
            raise ConfigError("", str(err)) from None
        _check_eval_arguments(cfg.data, splits.eval_datasets or {})
    model_len = OmegaConf.select(cfg, "model.max_seq_len")
    if settings.max_seq_len and model_len and settings.max_seq_len > model_len:
        raise ConfigError(
            "max_seq_len",
            f"{settings.max_seq_len} exceeds model.max_seq_len={model_len}; lower it or raise model.max_seq_len",
        )
    _check_autoresume(cfg, settings)
    _check_precision(cfg, settings)
    parallelism = parallelism_of(cfg)
    _check_mesh(cfg, settings, parallelism)
    micro = settings.device_train_microbatch_size
    if isinstance(micro, int) and micro > settings.global_train_batch_size:
        raise ConfigError(
            "device_train_microbatch_size",
            f"{micro} exceeds global_train_batch_size={settings.global_train_batch_size}",
        )
    return settings


def _float8_setting(cfg: DictConfig, settings: TrainSettings) -> str | None:
    """The key that asks for float8 matmuls on a GPU, or None: a float8 converter's node
    unless it emulates them, else precision=amp_fp8 (which adds one: `resolve_precision`)."""
    for name, node in (cfg.get("converters") or {}).items():
        target = node.get("_target_") if isinstance(node, DictConfig) else None
        if target == "llmfoundry.models.converters.Float8Training":
            return None if node.get("emulate") else f"converters.{name}"
    return "precision" if settings.precision == "amp_fp8" else None


# conf/model/custom.yaml's key besides its builder's arguments (llmfoundry/models/custom.py).
USER_MODEL_HINTS: dict[str, Any] = {"fsdp_blocks": list[str] | None}


def _user_model_hints(cfg: DictConfig, group: str) -> dict[str, Any] | None:
    """The model node's own keys when it is conf/model/custom.yaml's (your own module)."""
    node = cfg.get(group)
    if group != "model" or not isinstance(node, DictConfig) or "fsdp_blocks" not in node:
        return None
    if OmegaConf.is_missing(node, "_target_"):
        raise ConfigError(
            "model._target_",
            "missing: model=custom trains the module your function or class returns; name it: "
            "model._target_=my_pkg.build_model (README, Your own model)",
        )
    return USER_MODEL_HINTS


def _validate_group(cfg: DictConfig, group: str, hints: dict | None, static: bool) -> None:
    """`validate_targets` on one group; a builder of your own under a family's model group
    (MPT's defaults merged in) is told to use the custom group instead of its first MPT key."""
    try:
        validate_targets(group, cfg[group], hints, static)
    except ConfigError as err:
        target = OmegaConf.select(cfg, "model._target_", default=None)
        if group != "model" or "unknown key" not in str(err) or hints is not None:
            raise
        if not isinstance(target, str) or target.startswith("llmfoundry."):
            raise
        raise ConfigError(
            "model._target_",
            f"{target} is not a model family's config, so the model group's defaults "
            f"({str(err).partition(':')[0]}, ...) do not apply to it; for your own module use "
            f"model=custom model._target_={target} (README, Your own model)",
        ) from None


def _data_builder() -> types.ModuleType:
    """`llmfoundry.data.builder`, imported when the data group is checked: it loads torch, which
    the checks before it (top-level keys, the model) do without, so their errors are reported in
    about a second."""
    from llmfoundry.data import builder

    return builder


def _static_data_hints() -> dict[str, Any] | None:
    """`llmfoundry.data.builder.group_hints` read from the source (`static_schema`), or None
    when it cannot be: the data group's own keys, without importing the builder."""
    splits = static_fields("llmfoundry.data.builder.DataSplits")
    loader = static_schema("llmfoundry.data.streaming.StreamingDataLoader")
    if splits is None or loader is None:
        return None
    return splits | {key: loader.hints[key] for key in loader.keyword_only}


def _check_eval_arguments(data: DictConfig, eval_datasets: dict) -> None:
    """An ``eval_datasets`` entry that changes arguments of the main dataset takes that
    dataset's keys: checked as its node (entries with a ``_target_`` are checked as nodes
    of their own by validate_targets)."""
    target = data.get("_target_")
    if not isinstance(target, str):
        return
    for label, entry in eval_datasets.items():
        if isinstance(entry, dict) and "_target_" not in entry:
            node = OmegaConf.create({"_target_": target, "_partial_": True, **entry})
            validate_node(f"data.eval_datasets.{label}", node)


def _check_autoresume(cfg: DictConfig, settings: TrainSettings) -> None:
    """autoresume looks for the last checkpoint in save_folder: it must be the same next launch."""
    if not settings.autoresume:
        return
    raw = OmegaConf.to_container(cfg, resolve=False)
    folder, run_name = str(raw.get("save_folder")), str(raw.get("run_name"))
    if "${run_id:" in folder or ("${run_name}" in folder and "${run_id:" in run_name):
        raise ConfigError(
            "autoresume",
            f"save_folder={settings.save_folder} is named after this launch (run_name defaults "
            "to the start time), so a rerun would not find its checkpoints; set run_name=<name> "
            "or save_folder=<path or URL> to something that stays the same between launches",
        )


def _check_mesh(cfg: DictConfig, settings: TrainSettings, parallelism: dict[str, Any]) -> None:
    """What the mesh refuses whatever the world size, before any process starts: an axis the
    strategy cannot take (DDP and DeepSpeed: data parallelism only), and a training length the
    tensor- and context-parallel ranks cannot split (llmfoundry/distributed/mesh.py). The
    default mesh needs neither check (nor torch, which they import)."""
    axes = {k: v for k, v in parallelism.items() if k in ("dp_replicate", "cp", "tp", "pp")}
    ep = parallelism.get("ep", 1)
    if all(size == 1 for size in axes.values()) and ep == 1:
        return
    from llmfoundry.distributed.mesh import ParallelDims, check_sequence_length, refuse_axes

    name = strategy_name(cfg)
    try:
        if name is not None:
            refuse_axes({**axes, "ep": ep}, name)
        length = settings.max_seq_len or OmegaConf.select(cfg, "model.max_seq_len")
        if isinstance(length, int):
            dims = ParallelDims(world_size=math.prod(axes.values()), **axes)
            check_sequence_length(dims, length)
    except UserError as err:  # (its message names the key)
        raise ConfigError("", str(err)) from None


def _check_precision(cfg: DictConfig, settings: TrainSettings) -> None:
    """amp_fp16 runs only on CUDA, float8 (amp_fp8, the float8 converter) only on a GPU of
    compute capability 8.9+; say so now rather than when the trainer is built."""
    float8 = _float8_setting(cfg, settings)
    if settings.precision != "amp_fp16" and float8 is None:
        return
    import torch  # (only here: the rest of the check does not need it)

    device = str(OmegaConf.select(cfg, "strategy.device", default="auto"))
    on_cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    if float8 is not None:
        from llmfoundry.models.converters import float8_refusal

        if reason := float8_refusal(torch.device("cuda" if on_cuda else "cpu")):
            raise ConfigError(float8, reason)
    if settings.precision == "amp_fp16" and not on_cuda:
        raise ConfigError(
            "precision",
            f"amp_fp16 needs a CUDA device, but strategy.device={device} runs on the CPU here "
            "(fp16 matmul is unusably slow on CPU); use precision=amp_bf16 or fp32",
        )

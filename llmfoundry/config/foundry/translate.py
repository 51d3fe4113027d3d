"""An llm-foundry train YAML (its TrainConfig, llmfoundry/utils/config_utils.py) -> `Native`.

`load` reads the file as llm-foundry's train_from_yaml does (OmegaConf, command-line
``key=value`` merged over it, interpolations such as ``${variables.x}`` resolved; run_name
unset: $RUN_NAME). `translate` maps every TrainConfig key: to ours, to a note saying why it
needs no counterpart, or to a one-line refusal naming the key and what to use instead. A key
TrainConfig does not have is refused, as llm-foundry refuses it ("Unused parameters").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from llmfoundry.checkpoint.keys import WEIGHTS_ONLY
from llmfoundry.config.foundry import data, model, parallel, training
from llmfoundry.config.foundry.common import composer_time, only, refuse, run_name_field
from llmfoundry.config.foundry.native import Native
from llmfoundry.utils.errors import MissingInput, UserError

# Where inputs made before the run go (imports of transformers folders, instruction rows).
PREP_ROOT = "data/foundry-inputs"


def load(path: str | Path, args: Sequence[str] = ()) -> dict[str, Any]:
    """The YAML at `path` with llm-foundry-style overrides `args` merged, resolved."""
    if not Path(path).is_file():
        raise MissingInput(f"{path} not found: give an llm-foundry train YAML")
    cfg = OmegaConf.load(path)
    if not isinstance(cfg, DictConfig):
        raise UserError(f"{path}: an llm-foundry train YAML is a mapping of keys")
    for arg in args:
        if "=" not in arg:
            raise UserError(f"{arg!r}: overrides are key=value (e.g. model.n_layers=2)")
    try:
        cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(list(args)))
        resolved = OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", "") or ""
        raise UserError(f"{path}: {key + ': ' if key else ''}{str(err).splitlines()[0]}") from None
    return {str(k): v for k, v in resolved.items()}


def translate(cfg: Mapping[str, Any], env: Mapping[str, str], prep_root: str = PREP_ROOT) -> Native:
    """Our config for llm-foundry train config `cfg` (as `load` returns it); `env` gives
    $RUN_NAME and, under torchrun, WORLD_SIZE / LOCAL_WORLD_SIZE."""
    out = Native()
    model.model(cfg, out, prep_root)  # first: what the model is decides most refusals
    unknown = sorted(set(cfg) - set(HANDLED) - set(NOTED) - set(REFUSED_UNLESS))
    if unknown:
        raise refuse(
            unknown[0],
            "not a key of llm-foundry's train config (llm-foundry refuses it too); "
            "put values you interpolate under variables",
        )
    for key, (accepted, instead) in REFUSED_UNLESS.items():
        if key in cfg:
            only(key, cfg[key], accepted, instead)
    model.tokenizer(cfg, out)
    data.loaders(cfg, out, prep_root)
    training.optimizer(cfg, out)
    training.scheduler(cfg, out)
    training.algorithms(cfg, out)
    training.callbacks(cfg, out)
    training.icl_tasks(cfg, out)
    training.loggers(cfg, out)
    parallel.precision(cfg, out)
    parallel.strategy(cfg, env, out)
    _run(cfg, env, out)
    _batches(cfg, out)
    _checkpoints(cfg, out)
    for key, why in NOTED.items():
        if key in cfg:
            out.note(key, why)
    return out


def _run(cfg: Mapping[str, Any], env: Mapping[str, str], out: Native) -> None:
    for key in ("max_duration", "max_seq_len"):
        if cfg.get(key) is None:
            raise refuse(key, "missing: llm-foundry requires it too")
    out.set("max_duration", composer_time("max_duration", cfg["max_duration"]))
    out.set("max_seq_len", cfg["max_seq_len"])
    out.set("seed", cfg.get("seed", 17))
    run_name = cfg.get("run_name") or env.get("RUN_NAME")
    if run_name:
        out.set("run_name", run_name)
    out.set("eval_interval", composer_time("eval_interval", cfg.get("eval_interval", 1)))
    out.set("eval_first", bool(cfg.get("eval_first", False)))
    subset = cfg.get("eval_subset_num_batches", -1)
    out.set("eval_subset_num_batches", None if subset == -1 else subset)


def _batches(cfg: Mapping[str, Any], out: Native) -> None:
    if cfg.get("global_train_batch_size") is None:
        raise refuse(
            "global_train_batch_size",
            "missing: llm-foundry derives the per-device batch from it; give it",
        )
    out.set("global_train_batch_size", cfg["global_train_batch_size"])
    micro = cfg.get("device_train_microbatch_size", "auto")
    if micro != "auto" and (isinstance(micro, bool) or not isinstance(micro, int)):
        raise refuse("device_train_microbatch_size", f"{micro!r}: a whole number or auto")
    out.set("device_train_microbatch_size", micro)
    # llm-foundry: unset, the eval batch is the microbatch (1 under auto).
    default_eval = 1 if micro == "auto" else micro
    out.set("device_eval_batch_size", cfg.get("device_eval_batch_size", default_eval))


def _checkpoints(cfg: Mapping[str, Any], out: Native) -> None:
    folder = cfg.get("save_folder")
    out.set("save_folder", run_name_field("save_folder", folder))
    interval = composer_time("save_interval", cfg.get("save_interval", "1000ba"))
    out.set("save_interval", interval if folder is not None else None)  # no folder: no saves
    keep = cfg.get("save_num_checkpoints_to_keep", -1)
    if keep == 0:
        raise refuse(
            "save_num_checkpoints_to_keep",
            "0 (keep none on disk) is not supported; -1 keeps all, N the last N",
        )
    out.set("num_checkpoints_to_keep", keep)
    out.set("save_overwrite", bool(cfg.get("save_overwrite", False)))
    out.set("autoresume", bool(cfg.get("autoresume", False)))
    if cfg.get("load_path"):
        out.set("load_path", run_name_field("load_path", cfg["load_path"]))
    if cfg.get("load_weights_only") and cfg.get("load_path"):
        out.set("load_ignore_keys", list(WEIGHTS_ONLY))
    elif cfg.get("load_weights_only"):
        out.note("load_weights_only", "no load_path: no checkpoint is loaded (as in llm-foundry)")


# TrainConfig keys mapped by the functions above (and `variables`, consumed by `load`).
HANDLED: tuple[str, ...] = (
    "model", "tokenizer", "optimizer", "scheduler", "train_loader", "eval_loader",
    "eval_loaders", "algorithms", "callbacks", "loggers", "fsdp_config", "tp_config",
    "precision", "dist_timeout", "max_duration", "max_seq_len", "seed", "run_name",
    "eval_interval", "eval_first", "eval_subset_num_batches", "global_train_batch_size",
    "device_train_microbatch_size", "device_eval_batch_size", "save_folder", "save_interval",
    "save_num_checkpoints_to_keep", "save_overwrite", "autoresume", "load_path",
    "load_weights_only", "log_to_console", "console_log_interval", "progress_bar", "variables",
    "icl_tasks", "icl_tasks_str", "icl_subset_num_batches", "icl_seq_len",
)  # fmt: skip
# TrainConfig keys that change nothing here, and why.
NOTED: dict[str, str] = {
    "python_log_level": "the console shows INFO here (--debug shows tracebacks)",
    "log_config": "the run's config is always saved (outputs/<run_name>/.hydra/config.yaml)",
    "expandable_segments": "set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True in the "
    "environment for it",
    "spin_dataloaders": "a resumed run continues its data exactly without replaying batches",
    "flatten_metadata": "applies to metadata only",
}
# TrainConfig keys taken only at the value that is also our behaviour; otherwise refused.
REFUSED_UNLESS: dict[str, tuple[Any, str]] = {
    "code_paths": (None, "no code is imported from a config here; name your classes by _target_"),
    "max_split_size_mb": (None, "set PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:N instead"),
    "cuda_load_lazy": (False, "set CUDA_MODULE_LOADING=LAZY in the environment instead"),
    "accumulate_train_batch_on_tokens": (True, "microbatch losses are weighted by tokens here"),
    "eval_gauntlet": (None, "callbacks.icl_eval.gauntlet=FILE, or scripts/eval.py --gauntlet"),
    "eval_gauntlet_str": (None, "callbacks.icl_eval.gauntlet=FILE, or scripts/eval.py --gauntlet"),
    "save_latest_filename": (None, "checkpoints are folders here, `latest` names the last"),
    "save_filename": (None, "checkpoints are folders named ep<E>-ba<B> here"),
    "save_weights_only": (False, "checkpoints hold the full state; scripts/export_hf.py "
                          "writes the weights alone"),
    "load_strict_model_weights": (True, "weights always load strictly here"),
    "load_ignore_keys": (None, "use load_weights_only: true (Composer's key paths are not ours)"),
    "save_ignore_keys": (None, "checkpoints hold the full state here"),
    "only_hf_checkpoint": (False, "export with scripts/export_hf.py CKPT OUT"),
    "only_composer_checkpoint": (False, "a run here saves when it ends (save_folder)"),
    "train_subset_num_batches": (-1, "set max_duration in batches instead"),
    "compile_config": (None, "use model.compile=true (ours) after from_foundry.py"),
    "metadata": (None, "log it with loggers.wandb.tags or init_kwargs.config"),
    "profiler": (None, "use torch.profiler around scripts/train.py; no profiler key here"),
    "device_train_batch_size": (None, "set global_train_batch_size (llm-foundry derives it)"),
    "n_gpus": (None, "set by llm-foundry itself; remove it"),
    "device_train_grad_accum": (None, "set by llm-foundry itself; remove it"),
}  # fmt: skip

"""llm-foundry's optimizer, scheduler, algorithms, callbacks and loggers as our groups."""

from __future__ import annotations

from typing import Any

from llmfoundry.config.foundry.common import (
    check_known,
    composer_time,
    only,
    refuse,
    run_name_field,
    section,
)
from llmfoundry.config.foundry.native import Native

# llm-foundry's registered optimizers (llmfoundry/optim/__init__.py) -> ours (conf/optimizer/).
_OPTIMIZERS = {
    "decoupled_adamw": ("decoupled_adamw", {"lr", "betas", "eps", "weight_decay"}),
    "decoupled_lionw": ("decoupled_lionw", {"lr", "betas", "weight_decay"}),
}
# Composer's schedulers llm-foundry registers -> ours (conf/scheduler/), and the keys of each.
_SCHEDULERS = {
    "cosine_with_warmup": "cosine_with_warmup",
    "linear_decay_with_warmup": "linear_with_warmup",
    "constant_with_warmup": "constant_with_warmup",
    "inv_sqrt_with_warmup": "inverse_sqrt_with_warmup",
}
_SCHEDULER_KEYS = {
    "cosine_with_warmup": {"t_warmup", "alpha_f", "t_max", "scale_warmup"},
    "linear_decay_with_warmup": {"t_warmup", "alpha_i", "alpha_f", "t_max", "scale_warmup"},
    "constant_with_warmup": {"t_warmup", "alpha", "t_max", "scale_warmup"},
    "inv_sqrt_with_warmup": {
        "t_warmup",
        "t_scale",
        "t_cooldown",
        "t_max",
        "alpha_f_decay",
        "alpha_f_cooldown",
    },
}


_NO_MLFLOW = "no MLflow here: register the ba<N> folder it writes with MLflow yourself"
_NO_ARTIFACTS = "checkpoints are not uploaded to W&B here; save_folder takes an s3:// URL"


def optimizer(cfg: dict[str, Any], out: Native) -> None:
    node = section(cfg, "optimizer")
    name = node.pop("name", None)
    if name not in _OPTIMIZERS:
        raise refuse(
            "optimizer.name",
            f"{name!r} is not supported here; use one of {', '.join(_OPTIMIZERS)}",
        )
    ours, keys = _OPTIMIZERS[name]
    check_known("optimizer", node, keys)
    out.groups["optimizer"] = ours
    for key, value in node.items():
        out.set(f"optimizer.{key}", list(value) if key == "betas" else value)


def scheduler(cfg: dict[str, Any], out: Native) -> None:
    node = section(cfg, "scheduler")
    name = node.pop("name", None)
    if name not in _SCHEDULERS:
        raise refuse(
            "scheduler.name", f"{name!r} is not supported here; use one of {', '.join(_SCHEDULERS)}"
        )
    check_known("scheduler", node, _SCHEDULER_KEYS[name])
    where = f"scheduler ({name})"
    only("scheduler.t_max", node.pop("t_max", "1dur"), "1dur", "schedules here end at max_duration")
    only(
        "scheduler.scale_warmup",
        node.pop("scale_warmup", False),
        False,
        "warmup here always rises linearly from 0",
    )
    only("scheduler.alpha_i", node.pop("alpha_i", 1.0), 1.0, f"{where} starts decay from the lr")
    only("scheduler.alpha", node.pop("alpha", 1.0), 1.0, "scale optimizer.lr instead")
    out.groups["scheduler"] = _SCHEDULERS[name]
    # Their lr curve: Composer evaluates the schedule one batch behind ours (schedules.py).
    out.set("scheduler.composer_lag", True)
    warmup = composer_time("scheduler.t_warmup", node.pop("t_warmup", "0ba"))
    out.set("scheduler.t_warmup", warmup)
    if name == "inv_sqrt_with_warmup":
        _inverse_sqrt(node, warmup, out)
    elif "alpha_f" in node:
        out.set("scheduler.alpha_f", node.pop("alpha_f"))


def _inverse_sqrt(node: dict[str, Any], warmup: str, out: Native) -> None:
    """Composer's `alpha_f_decay + (1 - alpha_f_decay) / sqrt((t - t_warmup + t_scale) /
    t_scale)` with a linear cooldown is ours (`1 / sqrt(t / t_warmup)`) exactly when t_scale is
    t_warmup, nothing decays to a floor and there is no cooldown: those are taken, others refused."""
    instead = "here the inverse-sqrt schedule is 1/sqrt(t / t_warmup) (conf/scheduler/)"
    scale = composer_time("scheduler.t_scale", node.get("t_scale", warmup))
    only("scheduler.t_scale", scale, warmup, f"{instead}, so t_scale must equal t_warmup")
    cooldown = composer_time("scheduler.t_cooldown", node.get("t_cooldown", "0ba"))
    if not cooldown.startswith("0"):
        raise refuse("scheduler.t_cooldown", f"{cooldown}: no cooldown here; {instead}")
    only("scheduler.alpha_f_decay", node.get("alpha_f_decay", 0.0), 0.0, instead)
    only("scheduler.alpha_f_cooldown", node.get("alpha_f_cooldown", 0.0), 0.0, instead)
    out.set("scheduler.alpha_f", 0.0)


def algorithms(cfg: dict[str, Any], out: Native) -> None:
    chosen, converters = [], []
    for name, node in section(cfg, "algorithms").items():
        node = dict(node or {})
        key = f"algorithms.{name}"
        if name == "gradient_clipping":
            check_known(key, node, {"clipping_type", "clipping_threshold"})
            kind = node.get("clipping_type", "norm")
            if kind not in ("norm", "value"):
                raise refuse(f"{key}.clipping_type", f"{kind!r}: use norm or value")
            out.set(f"{key}.clipping_type", kind)
            out.set(f"{key}.threshold", node.get("clipping_threshold", 1.0))
            chosen.append(name)
        elif name == "low_precision_layernorm":
            check_known(key, node, set())
            converters.append(name)
        else:
            raise refuse(
                key,
                "not supported here (gradient_clipping and low_precision_layernorm are; "
                "ours: conf/algorithms/)",
            )
    out.groups["algorithms"] = chosen
    out.groups["converters"] = converters


def callbacks(cfg: dict[str, Any], out: Native) -> None:
    chosen = []
    for name, node in section(cfg, "callbacks").items():
        node = dict(node or {})
        key = f"callbacks.{name}"
        if name == "speed_monitor":
            check_known(key, node, {"window_size", "gpu_flops_available", "time_unit"})
            out.set(f"{key}.window_size", node.get("window_size", 100))  # Composer's default
            if node.get("gpu_flops_available") is not None:
                out.set(f"{key}.peak_flops", float(node["gpu_flops_available"]))
        elif name == "runtime_estimator":
            check_known(key, node, {"skip_batches", "time_unit"})
            if "skip_batches" in node:
                out.set(f"{key}.skip_batches", node["skip_batches"])
        elif name in ("lr_monitor", "memory_monitor"):
            check_known(key, node, set())
        elif name == "run_status":  # ours, by name: scripts/launch.py adds it to every run
            check_known(key, node, {"path", "interval_s"})
            for field, value in node.items():
                out.set(f"{key}.{field}", value)
        elif name == "hf_checkpointer":
            _hf_checkpointer(node, out, (cfg.get("model") or {}).get("name"))
        else:
            raise refuse(
                key,
                "not supported here (speed_monitor, lr_monitor, memory_monitor, "
                "runtime_estimator, hf_checkpointer are, and our run_status; "
                "ours: conf/callbacks/)",
            )
        if "time_unit" in node:
            out.note(f"{key}.time_unit", "times are reported in seconds and minutes here")
        chosen.append(name)
    out.groups["callbacks"] = chosen


def icl_tasks(cfg: dict[str, Any], out: Native) -> None:
    """Their in-training ICL evaluation is our icl_eval callback on the same tasks
    (llmfoundry/eval/foundry_tasks.py), every example at every evaluation, as theirs."""
    if cfg.get("icl_tasks") is not None and cfg.get("icl_tasks_str") is not None:
        raise refuse("icl_tasks_str", "give icl_tasks or icl_tasks_str, not both")
    only(
        "icl_subset_num_batches",
        cfg.get("icl_subset_num_batches"),
        None,
        "it counts their batches per rank; set callbacks.icl_eval.limit (examples per task)",
    )
    if cfg.get("icl_seq_len") not in (None, cfg.get("max_seq_len")):
        raise refuse("icl_seq_len", "set max_seq_len in each icl_tasks entry instead")
    tasks = cfg.get("icl_tasks", cfg.get("icl_tasks_str"))
    if tasks is None:
        return
    if not isinstance(tasks, str | list):
        raise refuse("icl_tasks", f"a list of task entries or a YAML path, got {tasks!r}")
    out.groups["callbacks"] = [*out.groups.get("callbacks", []), "icl_eval"]
    out.set("callbacks.icl_eval.icl_tasks", tasks)
    out.set("callbacks.icl_eval.limit", None)


def _hf_checkpointer(node: dict[str, Any], out: Native, model_name: Any) -> None:
    """Ours writes the same folders (`<save_folder>/huggingface/ba<N>`) in the same layout: for
    an `mpt_causal_lm` llm-foundry's MPT layout (`layout: foundry`), for an `hf_causal_lm` the
    transformers class it is. No remote code, so nothing to flatten, and no MLflow to register
    them in."""
    key = "callbacks.hf_checkpointer"
    for field in ("mlflow_registered_model_name", "mlflow_logging_config"):
        only(f"{key}.{field}", node.pop(field, None), None, _NO_MLFLOW)
    only(f"{key}.final_register_only", node.pop("final_register_only", False), False, _NO_MLFLOW)
    only(
        f"{key}.huggingface_folder_name",
        node.pop("huggingface_folder_name", "ba{batch}"),
        "ba{batch}",
        "export folders are named ba<N> here",
    )
    if "register_wait_seconds" in node:
        node.pop("register_wait_seconds")
        out.note(f"{key}.register_wait_seconds", "nothing is registered in MLflow here")
    if "flatten_imports" in node:
        node.pop("flatten_imports")
        out.note(f"{key}.flatten_imports", "the folder is transformers' own model, no remote code")
    check_known(key, node, {"save_folder", "save_interval", "precision", "overwrite"})
    for field in ("save_folder", "save_interval"):
        if node.get(field) is None:
            raise refuse(f"{key}.{field}", "missing: llm-foundry requires it too")
    out.set(f"{key}.save_folder", run_name_field(f"{key}.save_folder", node["save_folder"]))
    out.set(f"{key}.save_interval", composer_time(f"{key}.save_interval", node["save_interval"]))
    precision = node.get("precision", "float32")
    if precision not in ("float32", "float16", "bfloat16"):
        raise refuse(f"{key}.precision", f"{precision!r}: use float32, float16 or bfloat16")
    out.set(f"{key}.precision", precision)
    out.set(f"{key}.overwrite", bool(node.get("overwrite", True)))
    out.set(f"{key}.layout", "foundry" if model_name == "mpt_causal_lm" else "transformers")


def loggers(cfg: dict[str, Any], out: Native) -> None:
    """Their console settings (log_to_console, console_log_interval, progress_bar) and loggers;
    metrics.jsonl is always written (the run folder's record, read by scripts/plot.py)."""
    chosen = []
    if cfg.get("log_to_console", True):
        chosen.append("console")
        interval = composer_time("console_log_interval", cfg.get("console_log_interval", "1ba"))
        if not interval.endswith("ba"):
            raise refuse("console_log_interval", f"{interval}: give it in batches (e.g. 10ba)")
        out.set("loggers.console.log_interval", interval)
    if cfg.get("progress_bar", False):
        chosen.append("progress")
    chosen.append("jsonl")
    for name, node in section(cfg, "loggers").items():
        node = dict(node or {})
        key = f"loggers.{name}"
        only(f"{key}.rank_zero_only", node.pop("rank_zero_only", True), True, "rank 0 logs here")
        if name == "wandb":
            only(f"{key}.log_artifacts", node.pop("log_artifacts", False), False, _NO_ARTIFACTS)
            check_known(key, node, {"project", "entity", "name", "group", "tags", "init_kwargs"})
            for field, value in node.items():
                out.set(f"{key}.{field}", value)
        elif name == "tensorboard":
            check_known(key, node, {"log_dir", "flush_interval"})
            if "log_dir" in node:
                out.set(f"{key}.log_dir", node["log_dir"])
            interval = node.get("flush_interval", 100)  # Composer's default, in batches
            out.set(f"{key}.flush_interval", composer_time(f"{key}.flush_interval", interval, "ba"))
        else:
            raise refuse(key, "not supported here (wandb and tensorboard are; conf/loggers/)")
        chosen.append(name)
    out.groups["loggers"] = chosen

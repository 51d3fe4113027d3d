"""llm-foundry's fsdp_config, tp_config, precision and dist_timeout as our strategy group.

As llm-foundry does, one process trains without FSDP (it warns "FSDP is not applicable for
single-GPU training" and drops fsdp_config): strategy=single. Under torchrun (WORLD_SIZE > 1),
fsdp_config becomes strategy=fsdp (FSDP2): FULL_SHARD reshards parameters after the forward,
SHARD_GRAD_OP keeps them, HYBRID_SHARD shards within a node and replicates across nodes,
NO_SHARD is data parallel (strategy=ddp).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from llmfoundry.config.foundry.common import check_known, only, refuse, section
from llmfoundry.config.foundry.native import Native

PRECISIONS = ("fp32", "amp_bf16", "amp_fp16", "amp_fp8")
_SHARDING = ("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2", "NO_SHARD")
# Keys that tune FSDP1's internals, with why FSDP2 needs no counterpart.
_FSDP1_ONLY = {
    "limit_all_gathers": "FSDP2 needs no all-gather rate limit (it frees memory per module)",
    "activation_checkpointing_reentrant": "recomputation here is always torch's non-reentrant",
    "backward_prefetch": "FSDP2 prefetches the next module's all-gather itself",
    "forward_prefetch": "FSDP2 prefetches the next module's all-gather itself",
    "use_orig_params": "FSDP2 always keeps the original parameters",
    "sync_module_states": "every rank builds the same initial weights from the seed",
    "load_monolith_rank0_only": "checkpoints here load sharded on every rank",
    "verbose": "the strategy logs what it wraps at debug level",
    "state_dict_type": "checkpoints here are always sharded (torch.distributed.checkpoint) and "
    "load at any world size; scripts/convert_checkpoint.py writes one file",
    "activation_checkpointing_compute_dtype": "recomputation runs in the forward's dtype",
}
_FSDP_KEYS = {
    "sharding_strategy",
    "mixed_precision",
    "activation_checkpointing",
    "activation_cpu_offload",
    "cpu_offload",
    "data_parallel_shard_degree",
    "data_parallel_replicate_degree",
    *_FSDP1_ONLY,
}


def precision(cfg: Mapping[str, Any], out: Native) -> None:
    value = cfg.get("precision", "amp_bf16")  # llm-foundry's default
    if value not in PRECISIONS:
        raise refuse("precision", f"{value!r}: use one of {', '.join(PRECISIONS)}")
    out.set("precision", value)


def strategy(cfg: Mapping[str, Any], env: Mapping[str, str], out: Native) -> None:
    if cfg.get("tp_config") is not None:
        raise refuse(
            "tp_config",
            "llm-foundry's FFN-only tensor parallelism is not supported; here strategy=fsdp "
            "parallelism.tp=N splits attention and MLP (README, Parallelism)",
        )
    fsdp = section(cfg, "fsdp_config")
    check_known("fsdp_config", fsdp, _FSDP_KEYS)
    world = int(env.get("WORLD_SIZE", "1") or 1)
    timeout = float(cfg.get("dist_timeout", 600.0))
    if world == 1:
        out.groups["strategy"] = "single"
        if fsdp:
            out.note("fsdp_config", "one process trains without FSDP (as llm-foundry does)")
        if "dist_timeout" in cfg:
            out.note("dist_timeout", "one process: no collective to time out")
        return
    sharding = fsdp.get("sharding_strategy", "FULL_SHARD") if fsdp else "NO_SHARD"
    if sharding not in _SHARDING:
        raise refuse("fsdp_config.sharding_strategy", f"{sharding!r}: use one of {_SHARDING}")
    if sharding == "NO_SHARD":
        out.groups["strategy"] = "ddp"
        out.set("strategy.timeout_s", timeout)
        return
    out.groups["strategy"] = "fsdp"
    out.set("strategy.timeout_s", timeout)
    out.set("strategy.reshard_after_forward", sharding in ("FULL_SHARD", "HYBRID_SHARD"))
    if "HYBRID" in sharding or "data_parallel_replicate_degree" in fsdp:
        out.set("parallelism.dp_replicate", _replicas(fsdp, env, world))
    out.set("strategy.mixed_precision", _mixed_precision(fsdp, cfg, out))
    checkpointing = fsdp.get("activation_checkpointing", False)
    out.set("strategy.activation_checkpointing", "full" if checkpointing else "none")
    out.set("strategy.cpu_offload", bool(fsdp.get("cpu_offload", False)))
    only(
        "fsdp_config.activation_cpu_offload",
        fsdp.get("activation_cpu_offload", False),
        False,
        "activations stay on the device here; recompute them instead "
        "(fsdp_config.activation_checkpointing: true)",
    )
    for key, why in _FSDP1_ONLY.items():
        if key in fsdp:
            out.note(f"fsdp_config.{key}", why)


def _replicas(fsdp: Mapping[str, Any], env: Mapping[str, str], world: int) -> int:
    """Replicas of a hybrid mesh: data_parallel_replicate_degree, or world / shard degree, or
    (HYBRID_SHARD's default, one shard group per node) world / processes per node."""
    if (replicate := fsdp.get("data_parallel_replicate_degree")) is not None:
        return int(replicate)
    if (shard := fsdp.get("data_parallel_shard_degree")) is not None:
        return world // int(shard)
    return world // int(env.get("LOCAL_WORLD_SIZE", world) or world)


def _mixed_precision(fsdp: Mapping[str, Any], cfg: Mapping[str, Any], out: Native) -> str | None:
    """Composer's FSDP mixed_precision under precision amp_bf16: DEFAULT (bf16 parameters,
    fp32 gradient reduction) is our bf16; PURE (bf16 reductions too) becomes bf16 reducing in
    fp32 (more exact, as fast on the wire's critical path); FULL is fp32 throughout (null)."""
    value = fsdp.get("mixed_precision", "DEFAULT")
    amp = cfg.get("precision", "amp_bf16")
    if value not in ("DEFAULT", "PURE", "FULL"):
        raise refuse(
            "fsdp_config.mixed_precision",
            f"{value!r}: use DEFAULT, PURE or FULL (custom dtypes are not supported here)",
        )
    if value == "FULL" or amp == "fp32":
        return None
    if amp == "amp_fp16":
        raise refuse(
            "fsdp_config.mixed_precision",
            f"{value} with amp_fp16: FSDP here casts to bf16 only; use precision: amp_bf16",
        )
    if value == "PURE":
        out.note("fsdp_config.mixed_precision", "PURE: gradients are reduced in fp32 here")
    return "bf16"

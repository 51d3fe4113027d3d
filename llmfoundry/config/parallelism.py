"""The config's `parallelism:` block: the device mesh every strategy lays its processes out on.

conf/train.yaml holds one block, `parallelism: {dp_replicate, dp_shard, cp, tp, pp,
pp_schedule, ep}`, which llmfoundry/distributed/mesh.py (`parallel_dims`) turns into the run's
`ParallelDims`. The strategy group used to hold the axes (`strategy.tp`, `strategy.pp`,
`strategy.cp`, `strategy.replicate`, `strategy.pp_schedule`): those overrides still work as
aliases of the block's keys, with a one-line notice naming the new key, and are refused when
they contradict it (`resolve_aliases`). What can be checked without torch or a world size is
checked here, so `scripts/train.py`'s preflight answers in a second; the rest (the world size,
what a strategy can take) is the mesh's.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from llmfoundry.config.schema import ConfigError, check_keys, check_type

KEY = "parallelism"
# strategy.<old key> -> parallelism.<key>.
ALIASES = {
    "replicate": "dp_replicate",
    "tp": "tp",
    "pp": "pp",
    "cp": "cp",
    "pp_schedule": "pp_schedule",
}
# A strategy group node's `_target_` -> its name as a conf/strategy option, for the mesh's
# refusals (llmfoundry/distributed/mesh.py STRATEGY_AXES); DeepSpeed's adds its stage.
STRATEGY_NAMES = {
    "llmfoundry.distributed.SingleDevice": "single",
    "llmfoundry.distributed.DDP": "ddp",
    "llmfoundry.distributed.FSDP": "fsdp",
    "llmfoundry.distributed.DeepSpeed": "deepspeed_zero",
}


@dataclass(frozen=True)
class Parallelism:
    """The block's keys, their types and defaults (mesh.py `ParallelDims` has the same fields):
    processes per mesh axis, `dp_shard=-1` for what the others leave of the world; `ep`: the
    expert-parallel ranks, borrowed from dp_shard x cp."""

    dp_replicate: int = 1
    dp_shard: int = -1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    pp_schedule: str = "1f1b"
    ep: int = 1


DEFAULTS = Parallelism()


def resolve_aliases(cfg: DictConfig) -> list[str]:
    """Move the strategy group's old axis keys into `parallelism:`, in place (a null one is
    dropped: conf/strategy/fsdp.yaml keeps them null so `strategy.tp=2` still overrides), and
    return a notice for each that set something. An old key that contradicts the block's own
    (both set, to different values) is refused naming the new key."""
    strategy = cfg.get("strategy")
    if not isinstance(strategy, DictConfig):
        return []
    notices = []
    for old, new in ALIASES.items():
        if old not in strategy:
            continue
        value = strategy[old]
        with open_dict(strategy):
            del strategy[old]
        default = getattr(DEFAULTS, new)
        current = OmegaConf.select(cfg, f"{KEY}.{new}", default=default)
        if value is None or value == current:
            continue
        if current != default:
            raise ConfigError(
                f"strategy.{old}",
                f"{value} contradicts {KEY}.{new}={current}; strategy.{old} is the old name of "
                f"{KEY}.{new}: set only {KEY}.{new}",
            )
        with open_dict(cfg):
            if not isinstance(cfg.get(KEY), DictConfig):
                cfg[KEY] = {}
            cfg[KEY][new] = value
        notices.append(f"strategy.{old}={value} is {KEY}.{new}={value} now; use the new key")
    return notices


def parallelism_of(cfg: DictConfig) -> dict[str, Any]:
    """The block as a plain dict, its keys and types checked (ConfigError naming the key);
    absent: the defaults."""
    node = cfg.get(KEY)
    if node is None:
        return {}
    if not isinstance(node, DictConfig):
        raise ConfigError(KEY, f"expected a mapping of mesh axes, got {node!r}")
    hints = typing.get_type_hints(Parallelism)
    check_keys(KEY, [str(k) for k in node.keys()], list(hints))
    block = OmegaConf.to_container(node, resolve=True)
    for key, value in block.items():
        check_type(f"{KEY}.{key}", value, hints[key])
    return block


def strategy_name(cfg: DictConfig) -> str | None:
    """The strategy group's name (conf/strategy/<name>.yaml) from its `_target_`; None for a
    strategy of your own."""
    target = OmegaConf.select(cfg, "strategy._target_", default=None)
    name = STRATEGY_NAMES.get(target) if isinstance(target, str) else None
    if name == "deepspeed_zero":
        return f"{name}{OmegaConf.select(cfg, 'strategy.stage', default='')}"
    return name

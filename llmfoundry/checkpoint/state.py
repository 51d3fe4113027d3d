"""Model and optimizer state as a strategy holds it, for checkpoints: whole tensors for full
(single-file) checkpoints, this rank's part for the finiteness check before a save.

These were `Strategy` methods; they take the strategy (for what it can do: its flags, and
DeepSpeed's engine) and the model and optimizer as the strategy prepared them. By the model's
own names (no wrapper prefixes) and the optimizer's state keyed by parameter name, so a
checkpoint saved by one strategy loads into any other, at any world size. A strategy whose
engine saves and loads its own state (`Strategy.saves_own_checkpoints`: DeepSpeed's, which owns
its parameters and optimizer partitions) has its variants in deepspeed.py.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from llmfoundry.checkpoint import deepspeed
from llmfoundry.distributed import Strategy, unwrap_model

# Whole tensors on the CPU: what full (single-file) checkpoints hold. With a sharded model,
# torch gathers them on rank 0 only; the other ranks get an empty dict.
FULL_ON_CPU = StateDictOptions(full_state_dict=True, cpu_offload=True)


def local_weights(strategy: Strategy, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's part of every weight and buffer by name, where it lives (no copy, no
    communication): whole tensors, or this rank's shard of a sharded (DTensor) one; the
    same names in the same order on every rank (under pipeline parallelism other stages'
    weights are empty). What a save checks for NaN on all ranks
    before anything is written (finite.py)."""
    if strategy.saves_own_checkpoints:
        return deepspeed.local_weights(strategy)
    weights = {
        name: tensor.to_local() if isinstance(tensor, DTensor) else tensor
        for name, tensor in unwrap_model(model).state_dict().items()
    }
    if strategy.pipeline is not None:  # a stage's weights: other stages' names too
        return strategy.pipeline.with_other_stages(weights)
    return weights


def model_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Whole weights on the CPU by the model's own names (no wrapper prefixes); called on
    every rank, complete on rank 0."""
    return get_model_state_dict(model, options=FULL_ON_CPU)


def load_model_state_dict(
    strategy: Strategy, model: torch.nn.Module, state: dict[str, Any]
) -> None:
    """Load whole weights (every rank passes them); sharded models keep their own shard, and a
    pipeline stage its own modules' weights (the other stages' are theirs; any other key is
    still refused, as for a whole model)."""
    if strategy.saves_own_checkpoints:
        deepspeed.load_model_state_dict(strategy, state)
        return
    if strategy.pipeline is not None:
        others = _other_stages(strategy, model)
        state = {k: v for k, v in state.items() if k not in others}
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))


def optimizer_state_dict(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """The optimizer's state keyed by parameter name, whole tensors on the CPU, so it loads
    into any strategy; called on every rank, complete on rank 0."""
    return get_optimizer_state_dict(model, optimizer, options=FULL_ON_CPU)


def load_optimizer_state_dict(
    strategy: Strategy,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    state: dict[str, Any],
) -> None:
    """Load the optimizer state `optimizer_state_dict` returned (every rank passes it)."""
    if strategy.saves_own_checkpoints:
        deepspeed.refuse_full_optimizer_state(strategy)
    if strategy.pipeline is not None:  # a stage steps its own parameters only
        state = _stage_optimizer_state(state, _other_stages(strategy, model))
    # A stateless optimizer (SGD without momentum) has only hyperparameters, which torch
    # refuses to distribute as "full" state: they load as they are.
    full = bool(state.get("state"))
    set_optimizer_state_dict(
        model, optimizer, state, options=StateDictOptions(full_state_dict=full)
    )


def _other_stages(strategy: Strategy, model: torch.nn.Module) -> set[str]:
    """The names of the weights other pipeline stages hold, not this one (a tied embedding
    held by two stages is this one's too)."""
    return set(strategy.pipeline.with_other_stages({})) - set(model.state_dict())


def _stage_optimizer_state(state: dict[str, Any], others: set[str]) -> dict[str, Any]:
    """A whole model's optimizer state (by parameter name) less the parameters in `others`."""
    groups = [
        {
            **group,
            **{
                k: [n for n in group[k] if n not in others]
                for k in ("params", "param_names")
                if k in group
            },
        }
        for group in state.get("param_groups", [])
    ]
    kept = {name: value for name, value in state.get("state", {}).items() if name not in others}
    return {**state, "state": kept, "param_groups": groups}

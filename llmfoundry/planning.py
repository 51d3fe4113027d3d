"""Memory and time plan of a training run, before any weight is allocated.

Answers "does this config fit, with how large a microbatch, and how long is a step" for a world
size and a parallel strategy. Parameter count and flops per token come from the model itself
(any family's `num_params` and `flops_per_token`, built on the meta device, so nothing is
allocated), the same numbers the speed monitor's MFU uses; the family's spec gives the activation
bytes its blocks keep (`ModelFamily.activation_bytes`) and its parallel plan the sharded units. Memory per device is the sum of:

- parameters: float32 master weights (autocast keeps parameters in float32), 4 bytes each;
- gradients: float32, 4 bytes per parameter;
- optimizer state: 8 bytes per parameter for Adam (two moments), 4 for Lion (one);
- sharding divides these: DDP none; ZeRO-1 the optimizer state; ZeRO-2 also the gradients;
  FSDP full shard / ZeRO-3 all three; FSDP hybrid all three within a node's `gpus_per_node`.
  Sharded strategies add the working copy of the largest unit (a block of the family's parallel
  plan, or the root: the embedding, the final norm and an untied head) gathered in full, twice (the one in use and the one prefetched);
- CPU offload moves the optimizer state, and under FSDP / ZeRO-3 the sharded parameters and
  gradients, to host memory (left out of the device total);
- activations: what autograd keeps per block for the backward of our implementation (counted
  by the family: MPT's in models/mpt/spec.py, Llama's in models/llama/spec.py), per token; with activation checkpointing only each block's input
  plus one block's full activations (recomputed during backward);
- logits: the [microbatch, seq, vocab] output and its gradient, in the compute dtype.

Checked against peak memory measured on CPU (tests/test_planning.py) and against the published
MPT-7B / MPT-30B setups.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

from llmfoundry.models import parallel_plan
from llmfoundry.models.families import family_of
from llmfoundry.utils.errors import UserError

STRATEGIES = ("single", "ddp", "fsdp", "fsdp-hybrid", "zero1", "zero2", "zero3")

PRECISIONS = ("fp32", "amp_bf16", "amp_fp16")
# What each block saves with activation checkpointing: its float32 input.
CHECKPOINT_BYTES = 4
PARAM_BYTES = GRAD_BYTES = 4
_UNITS = {"kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_bytes(text: str) -> int:
    """'80GB', '141GiB', '512mb' or a plain number of bytes."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else ""
    if not match or (unit and unit not in _UNITS):
        raise UserError(f"memory size {text!r}: write a number with a unit, e.g. 80GB or 141GiB")
    return int(float(match.group(1)) * _UNITS.get(unit, 1))


def optimizer_state_bytes(optimizer_target: str) -> int:
    """Bytes of optimizer state per parameter, from the optimizer config's `_target_`."""
    name = optimizer_target.rsplit(".", 1)[-1].lower()
    if "lion" in name:
        return 4
    if "adam" in name:
        return 8
    if name == "sgd":
        return 4
    raise UserError(
        f"no optimizer-state size known for {optimizer_target!r}; the planner knows Adam/AdamW "
        "(8 bytes per parameter), Lion (4) and SGD with momentum (4)"
    )


@dataclass
class MemoryPlan:
    """Bytes per device of each part of a training step, and what it assumed."""

    n_params: int
    flops_per_token: int
    params: float
    grads: float
    optimizer: float
    working: float
    activations: float
    logits: float

    @property
    def total(self) -> float:
        return (
            self.params
            + self.grads
            + self.optimizer
            + self.working
            + self.activations
            + self.logits
        )


@dataclass
class Setup:
    """The run being planned: everything that changes memory per device."""

    model: Any  # a model config of any family (llmfoundry.models.families)
    seq_len: int
    precision: str = "amp_bf16"
    strategy: str = "single"
    world_size: int = 1
    gpus_per_node: int = 8
    activation_checkpointing: bool = False
    cpu_offload: bool = False
    optimizer_bytes: int = 8
    # Counted from the model on the meta device in __post_init__.
    n_params: int = dataclasses.field(init=False)
    flops_per_token: int = dataclasses.field(init=False)
    largest_unit: int = dataclasses.field(init=False)  # parameters of a sharded unit
    block_activation_bytes: int = dataclasses.field(init=False)  # per token

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise UserError(f"strategy {self.strategy!r}: use one of {', '.join(STRATEGIES)}")
        if self.precision not in PRECISIONS:
            raise UserError(f"precision {self.precision!r}: use fp32, amp_bf16 or amp_fp16")
        if self.world_size < 1 or self.gpus_per_node < 1:
            raise UserError("world_size and gpus_per_node must be positive")
        if self.strategy == "single" and self.world_size != 1:
            raise UserError("strategy single runs on one device: use --world-size 1 or ddp/fsdp")
        if self.cpu_offload and self.strategy in ("single", "ddp"):
            raise UserError("CPU offload needs a sharded strategy: fsdp, fsdp-hybrid or zero1-3")
        family = family_of(self.model)
        model = family.build(self.model, init_device="meta")
        self.n_params = model.num_params()
        self.flops_per_token = model.flops_per_token(self.seq_len)
        blocks = [sum(p.numel() for p in b.parameters()) for b in parallel_plan(model).blocks]
        root = sum(p.numel() for p in model.parameters()) - sum(blocks)
        self.largest_unit = max([root, *blocks])
        self.block_activation_bytes = family.activation_bytes(self.model, self.precision)


def _shards(setup: Setup) -> tuple[int, int, int]:
    """How many ways parameters, gradients and optimizer state are split across devices."""
    world = setup.world_size
    node = min(world, setup.gpus_per_node)
    return {
        "single": (1, 1, 1),
        "ddp": (1, 1, 1),
        "zero1": (1, 1, world),
        "zero2": (1, world, world),
        "zero3": (world, world, world),
        "fsdp": (world, world, world),
        "fsdp-hybrid": (node, node, node),
    }[setup.strategy]


def plan_memory(setup: Setup, microbatch: int) -> MemoryPlan:
    """Bytes per device for one forward and backward of `microbatch` sequences."""
    cfg = setup.model
    n_params = setup.n_params
    p_shards, g_shards, o_shards = _shards(setup)
    params = n_params * PARAM_BYTES / p_shards
    grads = n_params * GRAD_BYTES / g_shards
    optimizer = n_params * setup.optimizer_bytes / o_shards
    sharded_params = setup.strategy in ("fsdp", "fsdp-hybrid", "zero3")
    if setup.cpu_offload:
        optimizer = 0.0
        if sharded_params:
            params = grads = 0.0
    working = 0.0
    if sharded_params and p_shards > 1:
        working = 2 * setup.largest_unit * PARAM_BYTES
    tokens = microbatch * setup.seq_len
    per_block = setup.block_activation_bytes * tokens
    if setup.activation_checkpointing:
        blocks = cfg.n_layers * CHECKPOINT_BYTES * cfg.d_model * tokens + per_block
    else:
        blocks = cfg.n_layers * per_block
    # Embedding output, final norm input and the head's input (norm_f output).
    edges = (4 + 4 + (4 if setup.precision == "fp32" else 2)) * cfg.d_model * tokens
    compute_bytes = 4 if setup.precision == "fp32" else 2
    logits = 2 * tokens * cfg.vocab_size * compute_bytes
    return MemoryPlan(
        n_params=n_params,
        flops_per_token=setup.flops_per_token,
        params=params,
        grads=grads,
        optimizer=optimizer,
        working=working,
        activations=blocks + edges,
        logits=logits,
    )


def largest_microbatch(setup: Setup, device_memory: float, limit: int = 1 << 16) -> int:
    """The largest microbatch whose plan fits `device_memory` bytes; 0 if not even one does."""
    if plan_memory(setup, 1).total > device_memory:
        return 0
    low, high = 1, 2
    while high <= limit and plan_memory(setup, high).total <= device_memory:
        low, high = high, high * 2
    high = min(high, limit + 1)
    while high - low > 1:  # plan(low) fits, plan(high) does not
        mid = (low + high) // 2
        low, high = (mid, high) if plan_memory(setup, mid).total <= device_memory else (low, mid)
    return low


def step_seconds(
    flops_per_token: int, global_batch: int, seq_len: int, world_size: int, peak: float, mfu: float
) -> float:
    """Seconds per optimizer step when each device runs at `mfu` of its `peak` flop/s."""
    if not 0 < mfu <= 1:
        raise UserError(f"mfu must be in (0, 1], got {mfu}")
    return flops_per_token * global_batch * seq_len / world_size / (peak * mfu)

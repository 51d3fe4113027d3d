"""Parallelism applied to a model from outside, one function per technique, as torchtitan does.

A strategy's `prepare` calls them in torchtitan's order on the model family's plan
(llmfoundry/models/plan.py): `apply_tp` (the plan's tensor-parallel layout over the mesh's tp
axis: parameters become DTensors sharded across it), `apply_ac` (activation checkpointing wraps
each block's forward) and `apply_compile` (compiles each block, its checkpointing inside), then
`apply_fsdp` or `apply_ddp` over the data-parallel part of the mesh
(llmfoundry/distributed/mesh.py); FSDP's `parallelize` runs them all, DDP's `apply_plan` the
middle two. The model code knows nothing of any of them. DeepSpeed is the
exception: its engine wraps the model itself (llmfoundry/distributed/deepspeed.py).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import parallelize_module
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from llmfoundry.distributed.expert import apply_ep, experts_of
from llmfoundry.distributed.mesh import Mesh
from llmfoundry.models import find_plan, parallel_plan
from llmfoundry.models.plan import ParallelPlan
from llmfoundry.utils.errors import UserError

# What selective activation checkpointing keeps (torchtitan's save list): matrix multiplies'
# outputs (linear layers dispatch to these), the fused attention kernels' outputs (the costliest
# op after the matmuls; recomputing it would run attention three times per step: the sdpa
# backends, CPU's flash, FlexAttention) and tensor parallelism's reduce-scatters (a recompute
# would communicate again); everything else in a block is recomputed in backward.
_SAVED_BY_SELECTIVE = (
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.baddbmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch._higher_order_ops.flex_attention,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
)


# No buffer sync inside forward (see apply_ddp); newer torch names it forward_sync_buffers.
_NO_FORWARD_BUFFER_SYNC = (
    {"forward_sync_buffers": False}
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
    else {"broadcast_buffers": False}
)


@dataclass(frozen=True)
class ParallelSettings:
    """What `parallelize` applies besides the mesh: the `activation_checkpointing` setting (as
    `apply_ac` takes it) and fully_shard's `fsdp` options (reshard_after_forward, mp_policy,
    offload_policy)."""

    activation_checkpointing: str | int = "none"
    fsdp: Mapping[str, Any] = field(default_factory=dict)


def parallelize(
    model: torch.nn.Module, plan: ParallelPlan, mesh: Mesh, settings: ParallelSettings
) -> list[torch.nn.Module]:
    """Tensor parallelism over the mesh's tp axis (when it has one), activation checkpointing,
    compile (when the plan asks), then FSDP over its data-parallel axes (with the context-
    parallel one, `Mesh.fsdp_mesh`), the experts of an expert-parallel mesh (`apply_ep`, after
    tp) sharded first over the ranks left to them (`apply_expert_fsdp`): torchtitan's order
    (each later step wraps what the earlier made: FSDP shards the tensor-parallel DTensors
    again, over the other axes). Returns the FSDP units, blocks first."""
    if mesh.dims.tp > 1:
        apply_tp(model, plan, mesh.device_mesh["tp"], mesh.dims.cp)
    experts = experts_of(plan.blocks)
    if mesh.ep_mesh is not None:
        for module in experts:
            apply_ep(module, mesh.ep_mesh)
    apply_ac(plan.blocks, settings.activation_checkpointing)
    if plan.compile:
        apply_compile(plan.blocks)
    if mesh.expert_fsdp_mesh is not None:
        apply_expert_fsdp(experts, mesh.expert_fsdp_mesh, mesh.fsdp_mesh.size(), **settings.fsdp)
    return apply_fsdp(model, plan.blocks, mesh.fsdp_mesh, **settings.fsdp)


def check_tensor_parallel(plan: ParallelPlan, tp: int, setting: str = "parallelism.tp") -> None:
    """Refuse (one line, on every rank alike, before any collective) a tensor-parallel degree
    the model cannot take: a family without a layout, compiled blocks (torch 2.13's compiled
    backward through DTensor redistributions fails: probed on CPU with MPT's and Llama's
    layouts), or sizes `tp` does not divide. `setting` names where `tp` came from (the config
    key, or a script's flag)."""
    if plan.tensor_parallel is None:
        raise UserError(f"{setting}={tp}: {plan.tensor_parallel_refusal}")
    if plan.compile:  # torch 2.13: a DTensor redistribute's backward gets a plain tensor
        raise UserError(
            f"{setting}={tp} with compiled blocks (model.compile=true): in torch 2.13 their "
            "backward fails under tensor parallelism; set model.compile=false"
        )
    uneven = [f"{name}={size}" for name, size in plan.tp_divides.items() if size % tp]
    if uneven:
        raise UserError(
            f"{setting}={tp} does not divide the model's {', '.join(uneven)}: choose a tp "
            "that divides each (or a model whose sizes it divides)"
        )


def apply_tp(model: torch.nn.Module, plan: ParallelPlan, tp_mesh: DeviceMesh, cp: int = 1) -> None:
    """The plan's tensor-parallel layout (submodule -> torch's ParallelStyle) over `tp_mesh`:
    each named module's parameters become DTensors split across it, and its inputs and
    outputs are redistributed as its style says (`parallelize_module`). `cp`: the
    context-parallel degree, whose ranks' parts of each sequence tp splits further."""
    check_tensor_parallel(plan, tp_mesh.size())
    parallelize_module(model, tp_mesh, dict(plan.tensor_parallel))
    model.register_forward_pre_hook(
        functools.partial(_refuse_unsplittable_sequence, tp_mesh.size(), cp), with_kwargs=True
    )


def _refuse_unsplittable_sequence(
    tp: int, cp: int, _module: torch.nn.Module, args: tuple, kwargs: dict
) -> None:
    """Before a tensor-parallel forward: sequence parallelism splits dim 1 (the sequence of
    token ids [batch, seq], or of a pipeline stage's activations) over the tp ranks, so it must
    be a multiple of tp. Every tp rank has the same input, so all of them refuse it alike,
    before any collective could wait on a peer's shorter split. A later pipeline stage's input
    is this rank's split already: its forward's `seq_len` is the whole length. Under context
    parallelism (`cp` > 1) the forward's input is this rank's part of each sequence
    (llmfoundry/distributed/context.py), and that part is what tp splits."""
    inputs = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs"))
    if isinstance(inputs, Mapping):
        inputs = inputs.get("input_ids")
    length = kwargs.get("seq_len")
    if length is None and isinstance(inputs, torch.Tensor) and inputs.dim() >= 2:
        length = inputs.shape[1]
    if length is not None and length % tp and cp > 1:
        raise UserError(
            f"parallelism.tp={tp} splits each context-parallel rank's part of a sequence over "
            f"{tp} ranks, but parallelism.cp={cp} leaves this rank {length} of each sequence's "
            f"{length * cp} positions, not a multiple of {tp}: pad the batches to a multiple "
            f"of {2 * cp * tp} (the training loader does), or use parallelism.tp=1"
        )
    if length is not None and length % tp:
        raise UserError(
            f"parallelism.tp={tp} splits each sequence over {tp} ranks, but this input has "
            f"{length} positions, not a multiple of {tp}: pad the batches to a multiple "
            f"of {tp} (or max_seq_len), or use parallelism.tp=1"
        )


def apply_plan(
    model: torch.nn.Module, activation_checkpointing: str | int = "none"
) -> ParallelPlan | None:
    """What every strategy applies first, in order, to the blocks of the model family's plan:
    activation checkpointing, then compile (when the plan asks). Returns the plan, or None for
    a model of no family (nothing to apply; checkpointing one is refused: no blocks known)."""
    plan = find_plan(model) if activation_checkpointing == "none" else parallel_plan(model)
    if plan is None:
        return None
    apply_ac(plan.blocks, activation_checkpointing)
    if plan.compile:
        apply_compile(plan.blocks)
    return plan


def apply_ac(blocks: list[torch.nn.Module], setting: str | int) -> None:
    """Activation checkpointing of `blocks` by an `activation_checkpointing` setting: "none",
    "full" (every block), an integer k (every k-th block: 0, k, 2k, ...) or "selective"
    (every block, keeping its matrix multiplies' and attention's outputs: `checkpoint_blocks`)."""
    every, selective = _checkpointing(setting)
    checkpoint_blocks(blocks, every, selective)


def apply_compile(blocks: list[torch.nn.Module]) -> None:
    """Compile each block with torch.compile. Per block: each compiles once and is reused by
    every block of the same shape; `Module.compile` keeps parameter names, so checkpoints do
    not change."""
    for block in blocks:
        block.compile()


def apply_fsdp(
    model: torch.nn.Module, blocks: list[torch.nn.Module], mesh: DeviceMesh, **options: Any
) -> list[torch.nn.Module]:
    """Shard each block as one unit, then the root (what remains: embeddings, final norm),
    over `mesh`: one axis shards, two axes replicate across the first and shard within the
    second (hybrid). `options`: fully_shard's (reshard_after_forward, mp_policy,
    offload_policy). Returns the sharded units, blocks first."""
    for block in blocks:
        fully_shard(block, mesh=mesh, **options)
    fully_shard(model, mesh=mesh, **options)
    return [*blocks, model]


def apply_expert_fsdp(
    experts: list[torch.nn.Module], mesh: DeviceMesh, dp_ranks: int, **options: Any
) -> None:
    """Shard each experts module (its weights already split over the ep ranks) as a unit of
    its own over `mesh` (Mesh.expert_fsdp_mesh: the dp_shard x cp ranks ep leaves, across
    dp_replicate's replicas), before its block takes the rest. An expert's gradient on its
    ep rank sums the ep group's tokens' contributions (the all-to-all's backward), so it is
    divided by every data-parallel (x cp) rank, `dp_ranks`, as the other weights' are: FSDP
    would divide by `mesh`'s ranks alone."""
    for module in experts:
        fully_shard(module, mesh=mesh, **options)
        module.set_gradient_divide_factor(float(dp_ranks))


def apply_ddp(
    model: torch.nn.Module,
    group: dist.ProcessGroup | None,
    device: torch.device,
    find_unused_parameters: bool = False,
) -> DistributedDataParallel:
    """DistributedDataParallel over `group` (None: every process); it copies the group's first
    rank's weights to the others. Buffers are not synced on every forward: the models here hold
    only constant buffers, and a forward with no collective inside means an out-of-memory error
    on one rank cannot leave another waiting mid-forward."""
    return DistributedDataParallel(
        model,
        process_group=group,
        device_ids=[device.index] if device.type == "cuda" else None,
        **_NO_FORWARD_BUFFER_SYNC,
        find_unused_parameters=find_unused_parameters,
    )


def checkpoint_blocks(blocks: list[torch.nn.Module], every: int, selective: bool) -> None:
    """Recompute the activations of every `every`-th block in backward (0: none) instead of
    keeping them. `selective` keeps the outputs of the matrix multiplies and of the fused
    attention kernel (the ops that cost the flops; `_SAVED_BY_SELECTIVE`) and recomputes the
    rest (norms, activations, rotations), which cuts most of a block's activation memory for a
    few percent more compute."""
    options: dict[str, Any] = {"use_reentrant": False}
    if selective:
        options["context_fn"] = functools.partial(
            create_selective_checkpoint_contexts, list(_SAVED_BY_SELECTIVE)
        )
    for index, block in enumerate(blocks):
        if every and index % every == 0:
            block.forward = functools.partial(checkpoint, block.forward, **options)


def _checkpointing(value: str | int) -> tuple[int, bool]:
    """(every k-th block, selective) of an `activation_checkpointing` setting."""
    if value == "none":
        return 0, False
    if value in ("full", "selective"):
        return 1, value == "selective"
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value, False
    raise UserError(
        f"strategy.activation_checkpointing={value!r}: use 'none', 'full', 'selective' or a "
        "positive integer k (every k-th block)"
    )

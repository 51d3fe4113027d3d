"""Fully sharded data parallelism (FSDP2, torch's `fully_shard`) over torchrun's processes.

Each rank holds 1/N of every parameter, gradient and optimizer state instead of a whole copy:
a block's weights are all-gathered just before its forward (and again before its backward
when `reshard_after_forward`) and freed after; gradients are reduce-scattered so each rank
keeps the averaged gradient of its own shard, and its optimizer steps only that shard. The
blocks come from the model's parallelization plan (llmfoundry/models/plan.py); the root module
(embeddings, final norm) is sharded last.

The mesh comes from `parallelism` (the config's `parallelism:` block, llmfoundry/distributed/
mesh.py `parallel_dims`); FSDP takes every axis of it.

Hybrid sharding (`dp_replicate=R`): a 2-D device mesh (dp_replicate=R,
dp_shard=world_size/R) of R replicas of world_size/R ranks each;
parameters are sharded within a replica and gradients averaged across replicas, so all-gathers
stay within a replica (a node, typically) and only gradient averaging crosses replicas.

Tensor parallelism (`parallelism.tp=T`): the innermost mesh axis splits each block's matrices
across T ranks by the family's layout (llmfoundry/models/<family>/parallelize.py); FSDP shards the
result over the data-parallel axes (world_size / T ranks read different data, the T ranks of a
tensor-parallel group the same). `parallelize` (llmfoundry/distributed/parallelize.py) applies
both, with activation checkpointing and compile between them.

Context parallelism (`cp=C`, llmfoundry/distributed/context.py): the C ranks of a group read
the same batch and each computes its part of every sequence, all-gathering keys and values in
each layer; parameters are sharded over dp_shard x cp (`Mesh.fsdp_mesh`), whose gradients (of
different tokens) are averaged as data-parallel ranks' are.

Expert parallelism (`ep=P`, llmfoundry/distributed/expert.py): each MoE layer's experts are
split over P ranks borrowed from dp_shard x cp, its token copies sent to their experts' ranks
and back by all-to-alls; FSDP shards the experts over the dp_shard x cp / P ranks left
(`Mesh.expert_fsdp_mesh`) and every other weight over dp_shard x cp, as without it.

Initialization: the model is sharded on the meta device, each rank allocates only its shards,
and the model's own `init_weights` fills them. Random initializers get the whole tensor drawn
from rank 0's generator state and keep their slice (`_WholeTensorInit`), so a sharded
initialization equals the one-process initialization for the same seed, parameter by
parameter; only one parameter is ever whole at a time.

Pipeline parallelism (`parallelism.pp=P`, llmfoundry/distributed/pipeline.py) splits the model
into P stages along the mesh's outermost axis first; each stage is then split by its tensor-parallel
layout (what it holds of it) and sharded over the data-parallel axes as above.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
)
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from llmfoundry.distributed.base import OutOfMemoryElsewhere
from llmfoundry.distributed.context import ContextParallel, apply_cp, check_context_parallel
from llmfoundry.distributed.expert import check_expert_parallel
from llmfoundry.distributed.mesh import ParallelDims
from llmfoundry.distributed.parallelize import ParallelSettings, _checkpointing, parallelize
from llmfoundry.distributed.pipeline import Pipeline
from llmfoundry.distributed.process_group import ProcessGroupStrategy
from llmfoundry.distributed.torch_compat import fsdp_param_groups, reset_fsdp_iter_state
from llmfoundry.models import parallel_plan
from llmfoundry.utils.errors import UserError

_MIXED_PRECISION = {
    None: MixedPrecisionPolicy(),
    # Compute in bf16 (parameters gathered as bf16); reduce gradients in fp32 for accuracy.
    # Forward inputs are not cast: FSDP2 would cast every float tensor among each unit's
    # arguments to bf16, rebuilding each dataclass that holds them, so every block would get
    # its own copy of the forward's AttentionMask (whose memo then builds the attention bias
    # once per block, not once per forward), Llama's float32 RoPE cos/sin would reach the
    # blocks in bf16, and the model would extend a copy of a generation's KVCache (the
    # caller's would not advance). No unit needs the cast: the root's inputs are token ids,
    # and the activations a block (or a pipeline stage) receives are bf16 already, computed
    # with the embedding's bf16 parameters.
    "bf16": MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False
    ),
}
# Random initializers that must see the whole tensor: torch.nn.init's (which hand a tensor
# subclass such as DTensor to the torch-function mode as a `tensor=` keyword, before they reach
# a Tensor method, so those methods never show up in the mode)...
_RANDOM_INIT = {
    torch.nn.init.normal_,
    torch.nn.init.uniform_,
    torch.nn.init.trunc_normal_,
    torch.nn.init.kaiming_normal_,
    torch.nn.init.kaiming_uniform_,
    torch.nn.init.xavier_normal_,
    torch.nn.init.xavier_uniform_,
    torch.nn.init.orthogonal_,
    torch.nn.init.sparse_,
}
# ...and the in-place random Tensor methods, called directly.
_RANDOM_INPLACE = {
    torch.Tensor.normal_,
    torch.Tensor.uniform_,
    torch.Tensor.bernoulli_,
    torch.Tensor.random_,
    torch.Tensor.exponential_,
    torch.Tensor.cauchy_,
    torch.Tensor.log_normal_,
    torch.Tensor.geometric_,
}


class FSDP(ProcessGroupStrategy):
    """FSDP2 over the processes `torchrun` started.

    Args:
        device, backend, timeout_s: as for DDP.
        parallelism: the mesh, every axis of it (mesh.py `parallel_dims`: the config's
            `parallelism:` block or a ParallelDims; None: shard over all ranks). dp_replicate:
            replicas of the hybrid-sharding mesh; tp: tensor-parallel ranks per data-parallel
            rank (the mesh's innermost axis; it must divide the model's head counts and widths,
            checked when the model is prepared); pp: pipeline stages (pipeline.py), each
            sharded over world_size / pp processes, run by pp_schedule ("1f1b": at least pp
            microbatches per step, or "gpipe"); cp: each sequence split over cp ranks
            (context.py), parameters sharded over dp_shard x cp. ep: each MoE layer's experts
            split over ep ranks of dp_shard x cp (expert.py; it must divide that and the
            expert count).
        reshard_after_forward: free gathered block weights after forward (and gather them again
            for backward): less memory, one more all-gather per block.
        mixed_precision: None (parameters and gradients in their own dtype) or "bf16"
            (compute in bf16, reduce gradients in fp32, keep fp32 shards for the optimizer).
        cpu_offload: keep parameter, gradient and optimizer shards in CPU memory; the device
            holds only the gathered blocks in use.
        activation_checkpointing: "none", "full" (recompute every block's activations in
            backward), an integer k (every k-th block: 0, k, 2k, ...), or "selective" (every
            block, but the outputs of its matrix multiplies and attention are kept, so backward
            recomputes only the cheap element-wise ops: `checkpoint_blocks`).
        async_save: write checkpoint shards in the background (`dcp.async_save`, over a gloo
            process group of its own) while training goes on; the shards are copied to CPU
            memory first (one more copy of the rank's model and optimizer state there). The
            checkpoint counts (manifest, `latest`) once the write is done, which the checkpoint
            saver waits for before the next save and at the end of the run.
    """

    name = "fsdp"
    sharded_checkpoints = True

    def __init__(
        self,
        device: str = "auto",
        backend: str | None = None,
        timeout_s: float = 1800.0,
        reshard_after_forward: bool = True,
        mixed_precision: str | None = None,
        cpu_offload: bool = False,
        activation_checkpointing: str | int = "none",
        async_save: bool = False,
        parallelism: Mapping[str, Any] | ParallelDims | None = None,
    ) -> None:
        super().__init__(device, backend, timeout_s, parallelism)
        dims = self.dims
        self.pipeline = Pipeline(dims.pp, dims.pp_schedule) if dims.pp != 1 else None
        if mixed_precision not in _MIXED_PRECISION:
            raise UserError(
                f"strategy.mixed_precision={mixed_precision!r}: use null (no cast) or 'bf16'"
            )
        _checkpointing(activation_checkpointing)  # refused here, before any process waits
        self.activation_checkpointing = activation_checkpointing
        self.reshard_after_forward = reshard_after_forward
        self.mixed_precision = mixed_precision
        self.cpu_offload = cpu_offload
        self.async_save = async_save
        # The sharded modules (the plan's blocks, then the root), set by `prepare`.
        self._units: list[torch.nn.Module] = []
        self._auto_microbatching = False
        self._guarded = False  # (`guard_collectives`)
        self._guards: list[RemovableHandle] = []

    def setup(self) -> None:
        super().setup()
        if self.cp > 1:  # (context.py)
            cp_mesh = self.mesh.cp_mesh
            self.context = ContextParallel(self.cp, cp_mesh.get_local_rank(), cp_mesh.get_group())
        if self.async_save:  # (see Strategy.save_group)
            self.save_group = dist.new_group(backend="gloo", timeout=self.timeout)

    def prepare(self, model: torch.nn.Module) -> torch.nn.Module:
        # A model of no family has no blocks to shard: parallel_plan refuses it, naming those that do.
        plan = parallel_plan(model)
        options: dict[str, Any] = {
            "reshard_after_forward": self.reshard_after_forward,
            "mp_policy": _MIXED_PRECISION[self.mixed_precision],
            "offload_policy": CPUOffloadPolicy(pin_memory=self.device.type == "cuda")
            if self.cpu_offload
            else OffloadPolicy(),
        }
        if self.context is not None:  # refused before any collective
            check_context_parallel(plan, self.cp)
        if self.dims.ep > 1:
            check_expert_parallel(model, plan, self.dims.ep)
        pipeline = self.pipeline
        if pipeline is not None:
            plan = pipeline.split(model, plan, self.mesh)
        settings = ParallelSettings(self.activation_checkpointing, options)
        self._units = parallelize(model, plan, self.mesh, settings)
        if self.context is not None:
            apply_cp(model, self.context)
        if any(p.is_meta for p in model.parameters()):
            model.to_empty(device="cpu" if self.cpu_offload else self.device)
            absent = nullcontext() if pipeline is None else pipeline.absent_restored(model)
            with self.rank0_generator(), _WholeTensorInit(self.device), absent:
                model.init_weights()
        if pipeline is not None:
            pipeline.build(model, self.device)
        return model

    # ------------------------------------------------------------------ the training step
    def sync_context(self, model: torch.nn.Module, sync: bool) -> AbstractContextManager:
        """Reduce-scatter gradients only on the last microbatch (`sync`); with auto-
        microbatching every microbatch reduces its own, so an abandoned attempt leaves no
        unreduced gradient behind, and (once the size has settled too) memory stays what the
        search measured: accumulating would hold a whole unsharded gradient."""
        return _gradient_sync(model, sync or self._auto_microbatching)

    def guard_collectives(self, model: torch.nn.Module, guard: bool = True) -> None:
        """Auto-microbatching, while the trainer searches for a microbatch size that fits
        (`guard`): before each block's forward and backward (where FSDP gathers and reduces),
        all ranks agree on whether one ran out of memory. A rank that did joins the agreement
        from the trainer (`Trainer._out_of_memory_on_any_rank`) instead of the next collective,
        so every rank leaves the step together and none waits in an all-gather or
        reduce-scatter another abandoned. Refused with tensor parallelism: its collectives run
        inside each block, past any agreement before it. Context parallelism's run inside each
        block too, but two per layer, each preceded by an agreement (`ContextParallel.guard`):
        before the keys' all-gather, and before its backward's reduce-scatter.

        Each agreement is an all-reduce read on the host, three per unit (the blocks, the root)
        and step, which stops the host queueing kernels ahead and so FSDP's prefetch; once the
        size has settled (`guard` False) the hooks come off. An out-of-memory error after that cannot be agreed on (the
        other ranks are inside a collective this rank left): the trainer raises it as a clear
        error (`out_of_memory_retryable`), torchrun ends the other ranks within seconds, and a
        resumed run searches again. A settled size has run the steady state of memory (the
        optimizer's state allocated, `Trainer` SETTLE_STEPS), so what remains is a longer
        batch or fragmentation, rare against a sync per block on every step."""
        if self.tp > 1:
            raise UserError(
                f"device_train_microbatch_size=auto with parallelism.tp={self.tp}: an "
                "out-of-memory error inside a block would leave its tensor-parallel peers "
                "waiting; set a fixed device_train_microbatch_size"
            )
        if self.context is not None:  # its gathers agree too, inside each block
            self.context.guard = self._agree if guard else None
        self._auto_microbatching = True
        if guard and not self._guarded:
            for unit in self._units:
                self._guards += [
                    unit.register_forward_pre_hook(self._agree_before_forward, prepend=True),
                    unit.register_full_backward_pre_hook(self._agree, prepend=True),
                    unit.register_full_backward_hook(self._agree),
                ]
        elif not guard:
            for handle in self._guards:
                handle.remove()
            self._guards = []
        self._guarded = guard

    @property
    def out_of_memory_retryable(self) -> bool:
        return self._guarded

    def abandon_step(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Also reset FSDP's per-step state (gathered blocks, half-run hooks) after a forward
        or backward that an out-of-memory error cut short, and drop the gradients a cut-short
        backward left on gathered (unsharded) parameters: FSDP would otherwise add them into
        the next reduce-scatter. torch has no public call for the latter (2.13), and 2.11 none
        for either (torch_compat.py)."""
        reset_fsdp_iter_state(model)
        for unit in self._units:
            for group in fsdp_param_groups(unit):
                for param in group.fsdp_params:
                    param.unsharded_accumulated_grad = None
                    if getattr(param, "_unsharded_param", None) is not None:
                        param._unsharded_param.grad = None
        super().abandon_step(model, optimizer)

    def _agree_before_forward(self, *_: Any) -> None:
        if torch.is_grad_enabled():  # evaluation runs without grad, and never retries
            self._agree()

    def _agree(self, *_: Any) -> None:
        flag = torch.zeros(1, device=self.device)
        if self.all_reduce_sum(flag).item() > 0:
            raise OutOfMemoryElsewhere("out of memory on another rank (agreed at a collective)")


@contextmanager
def _gradient_sync(model: torch.nn.Module, sync: bool):
    if not isinstance(model, FSDPModule) or sync:
        yield
        return
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


class _WholeTensorInit(TorchFunctionMode):
    """Random initializers on a sharded parameter draw the whole tensor (same numbers as one
    process would draw, with the same generator state) and keep this rank's part of it, for
    any DTensor layout (FSDP's shards, tensor-parallel splits, both: `distribute_tensor`
    slices by the placements, strided ones included). Without this, DTensor's own random ops
    would draw each shard from an offset of the generator: consistent across ranks, but not
    one process's weights. On a parameter left on the meta device (another pipeline stage's)
    they draw it whole and keep nothing, so the generator moves on as in one process."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = dict(kwargs or {})
        keyword = not args and func in _RANDOM_INIT  # torch.nn.init's own dispatch
        target = kwargs.get("tensor") if keyword else args[0] if args else None
        sharded = isinstance(target, DTensor)
        absent = isinstance(target, torch.Tensor) and not sharded and target.is_meta
        if func not in _RANDOM_INPLACE | _RANDOM_INIT or not (sharded or absent):
            return func(*args, **kwargs)
        local = target.to_local() if sharded else None
        device = self.device if local is None else local.device
        whole = torch.empty(target.shape, dtype=target.dtype, device=device)
        if keyword:
            func(**{**kwargs, "tensor": whole})
        else:
            func(whole, *args[1:], **kwargs)
        if sharded:
            shard = distribute_tensor(
                whole, target.device_mesh, target.placements, src_data_rank=None
            )
            local.copy_(shard.to_local())
        return target

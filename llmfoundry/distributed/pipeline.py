"""Pipeline parallelism (`parallelism.pp=P`): each process along the mesh's pp axis holds one stage
of the model, a contiguous run of its blocks, and a schedule (torch.distributed.pipelining)
runs the step's microbatches through the stages, sending activations forward and their
gradients back.

A stage is the model itself with what other stages hold replaced by `Absent` modules (no
parameters, their input passed through), as torchtitan splits its models: parameter names stay
those of the whole model, so a stage's checkpoint shards (DCP) fit the whole model at any mesh.
The family's plan says what the first and last stages hold and how a stage runs
(`PipelineSplit`, llmfoundry/models/plan.py); the stage's forward replaces the model's from
outside, as activation checkpointing wraps a block's. A tied embedding (MPT's token embedding is
also the output head) is held by the first and the last stage, initialized alike, and its
gradients summed over the two after each step, so the copies take the same optimizer steps.

Initialization matches one process: the modules of other stages are put back on the meta device
while the model initializes, and the random initializers draw (and drop) their values too
(fsdp.py's `_WholeTensorInit`), so every stage's weights are those one process would draw.

The trainer hands the step to `Pipeline.step` (the microbatch events fire once per step:
llmfoundry/core/events.md). The loss function weights each microbatch by its loss tokens as the
trainer's loop does; the last stage holds the loss and sums it to every stage. Evaluation runs
forward only (`forward_only`, GPipe without backward): the last stage's logits feed the
metrics, whose totals are then summed over the stages (`sum_over_stages`).

With context parallelism (llmfoundry/distributed/context.py) the trainer hands the stages this
rank's part of each sequence (`ContextParallel.shard`: its token ids, the shifted targets the
last stage's loss reads, the whole sequence_id), and each stage's forward makes the keys of its
microbatch from that microbatch's sequence_id (`apply_cp`), so every stage gathers the other
ranks' keys in its own blocks.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.pipelining.schedules import PipelineScheduleSingle
from torch.distributed.tensor import DTensor

from llmfoundry.core.loss import targets_of
from llmfoundry.core.metrics import loss_token_count
from llmfoundry.distributed.mesh import Mesh, check_schedule
from llmfoundry.models.plan import ParallelPlan
from llmfoundry.utils.errors import UserError

# `parallelism.pp_schedule` -> the schedule; 1F1B keeps at most pp microbatches' activations
# alive. The names are mesh.py's PIPELINE_SCHEDULES (ParallelDims checks them).
SCHEDULES: dict[str, type[PipelineScheduleSingle]] = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}
# Schedules that need at least pp microbatches per step (to keep every stage busy).
_NEED_PP_MICROBATCHES = ("1f1b",)

LossFn = Callable[[Any, Mapping[str, torch.Tensor]], torch.Tensor]


class Absent(nn.Module):
    """A module another pipeline stage holds: passes its first input through."""

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        del args, kwargs
        return x


def stage_blocks(n_blocks: int, stages: int, stage: int) -> range:
    """The blocks stage `stage` of `stages` holds: contiguous, as even as can be, the earlier
    stages one more where they do not divide."""
    per_stage, extra = divmod(n_blocks, stages)
    start = stage * per_stage + min(stage, extra)
    return range(start, start + per_stage + (stage < extra))


def check_pipeline_split(
    plan: ParallelPlan, pp: int, setting: str = "parallelism.pp", name: str = "this model"
) -> None:
    """Refuse `pp` stages of a model (its family's `plan`) that cannot be split so: a family
    without a pipeline split, a model its plan refuses (`pipeline_refusal`), or more stages
    than blocks (each stage holds at least one).
    Training, `load_on_mesh` and the planner (llmfoundry/planning.py) ask this one check;
    `setting` names where `pp` came from."""
    if pp > 1 and plan.pipeline is None:
        raise UserError(
            f"{setting}={pp}: {name} has no pipeline split in its family's plan; use {setting}=1"
        )
    if pp > 1 and plan.pipeline_refusal:
        raise UserError(f"{setting}={pp}: {plan.pipeline_refusal}; use {setting}=1")
    if pp > len(plan.blocks):
        raise UserError(
            f"{setting}={pp} exceeds the model's {len(plan.blocks)} blocks (each pipeline stage "
            f"holds at least one); use at most pp={len(plan.blocks)}"
        )


class Pipeline:
    """This process's pipeline stage and the schedule that runs it (`split`, `build`, `step`)."""

    def __init__(self, pp: int, schedule: str) -> None:
        self.pp, self.schedule_name = pp, check_schedule(schedule)  # (ParallelDims checks pp)
        self.stage_index = 0
        self._absent: dict[str, nn.Module] = {}  # module name -> the meta module it replaced
        self._tied_modules: tuple[str, ...] = ()  # held by the first and the last stage
        self._tied: list[nn.Parameter] = []
        self._tied_group: dist.ProcessGroup | None = None
        self._pp_group: dist.ProcessGroup | None = None
        self._model: nn.Module | None = None  # the stage's module and device (`build`)
        self._device: torch.device | None = None
        self._stage: PipelineStage | None = None
        self._schedules: dict[int, PipelineScheduleSingle] = {}
        self._loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
        # Evaluation's stages and schedules, by batch shape (`forward_only`).
        self._eval_schedules: dict[tuple[int, ...], ScheduleGPipe] = {}

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.pp - 1

    def split(self, model: nn.Module, plan: ParallelPlan, mesh: Mesh) -> ParallelPlan:
        """Replace what other stages hold in `model` (on the meta device) by `Absent`; returns
        the plan of this stage (the blocks it holds, their tensor-parallel layout). A
        collective: every process creates the groups."""
        check_pipeline_split(plan, self.pp, name=type(model).__name__)
        split = plan.pipeline
        self.stage_index = mesh.dims.coordinates(dist.get_rank())["pp"]
        self._groups(mesh)
        names = {id(module): name for name, module in model.named_modules()}
        held = stage_blocks(len(plan.blocks), self.pp, self.stage_index)
        blocks = [names[id(block)] for block in plan.blocks]
        absent = [name for index, name in enumerate(blocks) if index not in held]
        if not self.is_first:
            absent += split.first
        if not self.is_last:
            absent += split.last
        if not (self.is_first or self.is_last):
            absent += split.tied
        for name in absent:
            if name in names.values():  # optional modules (a learned position table)
                self._absent[name] = _replace(model, name, Absent())
        if self.is_first or self.is_last:
            self._tied_modules = split.tied
        model.forward = functools.partial(
            split.forward, model, first=self.is_first, last=self.is_last
        )
        layout = plan.tensor_parallel
        if layout is not None:  # the tensor-parallel styles of what this stage holds
            layout = {name: style for name, style in layout.items() if not self._is_absent(name)}
        return dataclasses.replace(
            plan, blocks=[plan.blocks[index] for index in held], tensor_parallel=layout
        )

    def _is_absent(self, name: str) -> bool:
        """Whether module `name` is (or sits inside) a module another stage holds."""
        return any(name == other or name.startswith(other + ".") for other in self._absent)

    def _groups(self, mesh: Mesh) -> None:
        """The pp group (this process's column of stages) and the first and last stages' group
        of each column (where the tied weights' gradients are summed)."""
        device_mesh = mesh.device_mesh
        self._pp_group = device_mesh["pp"].get_group()
        columns = device_mesh.mesh.reshape(self.pp, -1).T.tolist()
        for column in columns:  # every process creates every group, in the same order
            group = dist.new_group([column[0], column[-1]])
            if dist.get_rank() in (column[0], column[-1]):
                self._tied_group = group

    @contextmanager
    def absent_restored(self, model: nn.Module) -> Iterator[None]:
        """The other stages' modules (on the meta device) back in `model` while it initializes,
        so its initializers draw what one process would (see the module docstring)."""
        present = {name: _replace(model, name, module) for name, module in self._absent.items()}
        try:
            yield
        finally:
            for name, module in present.items():
                _replace(model, name, module)

    def with_other_stages(self, weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`weights` (this stage's, by name) with every other stage's names too, as empty
        tensors, sorted by name: the same names in the same order on every process, for checks
        that reduce a flag per weight over all of them (checkpoint/finite.py)."""
        whole = dict(weights)
        for name, module in self._absent.items():
            for key, tensor in module.state_dict().items():
                whole.setdefault(f"{name}.{key}", torch.empty(0, dtype=tensor.dtype))
        return dict(sorted(whole.items()))

    def build(self, model: nn.Module, device: torch.device) -> None:
        """This process's stage of the materialized (and sharded) `model`."""
        # Sharding replaced the parameters: the tied ones are looked up now.
        self._tied = [
            p for name in self._tied_modules for p in model.get_submodule(name).parameters()
        ]
        self._model, self._device = model, device
        self._stage = self._new_stage()

    def _new_stage(self) -> PipelineStage:
        return PipelineStage(
            self._model, self.stage_index, self.pp, self._device, group=self._pp_group
        )

    def _stage_args(self, batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """The stage's input: the token ids on the first stage; the other stages receive theirs
        from the stage before and take none (torch 2.11's schedules refuse any there, 2.13's
        ignore them)."""
        return (batch["input_ids"],) if self.is_first else ()

    @staticmethod
    def _stage_kwargs(batch: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        """What every stage's forward takes besides its input: the sequence length of its
        tokens (a context-parallel rank's part: then each stage's forward makes its keys from
        it, llmfoundry/distributed/context.py) and the documents' ids, if the batch has them
        (the whole sequence's: chunked by rows like the inputs, one microbatch's each)."""
        kwargs: dict[str, Any] = {"seq_len": batch["input_ids"].shape[1]}
        if "sequence_id" in batch:
            kwargs["sequence_id"] = batch["sequence_id"]
        return kwargs

    def step(
        self,
        batch: Mapping[str, torch.Tensor],
        microbatch_size: int | None,
        loss_fn: LossFn,
        loss_weight: Callable[[Mapping[str, torch.Tensor]], torch.Tensor],
    ) -> torch.Tensor:
        """Forward and backward of `batch` in microbatches of `microbatch_size` (None: one)
        through the pipeline; returns the loss summed over the batch's loss tokens (float64,
        the same on every stage). `batch` has `labels`, or is a context-parallel rank's part of
        one (llmfoundry/distributed/context.py: its shifted `targets`, the whole `sequence_id`,
        which each stage's keys read). `loss_weight(targets)`: what a microbatch's mean loss is
        multiplied by for its backward (the trainer's token weighting; `{"targets": ...}`)."""
        n_microbatches = self.microbatches(batch["input_ids"].shape[0], microbatch_size)
        schedule = self._schedule(n_microbatches)
        # Each microbatch's (mean loss, loss tokens); the schedule also calls the loss function
        # on placeholders once, to learn the shapes of the gradients (its first step).
        losses: list[tuple[torch.Tensor, torch.Tensor]] = []

        def weighted_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            shifted = {"targets": targets}
            loss = loss_fn(outputs, shifted)
            losses.append((loss.detach(), loss_token_count(shifted)))
            return loss * loss_weight(shifted)

        self._loss_fn = weighted_loss
        targets = targets_of(batch)
        schedule.step(
            *self._stage_args(batch),
            target=targets,
            return_outputs=False,
            **self._stage_kwargs(batch),
        )
        self._sum_tied_gradients()
        loss_sum = torch.zeros((), dtype=torch.float64, device=targets.device)
        for loss, tokens in losses[-n_microbatches:] if self.is_last else []:
            loss_sum += loss.double() * tokens
        dist.all_reduce(loss_sum, group=self._pp_group)  # zero on all but the last stage
        return loss_sum

    def forward_only(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
        """The logits of `batch` (evaluation: forward only, in up to pp microbatches through
        the stages): on the last stage; None on the others. Each batch shape gets a stage and
        schedule of its own, as a stage's receive buffers are laid out for one shape (the
        training stage's for its microbatches); so the microbatches split the rows evenly
        (`even_microbatches`): 7 rows in 4 and 3 would receive the second into 4 rows' buffers."""
        shape = tuple(batch["input_ids"].shape)
        if shape not in self._eval_schedules:
            self._eval_schedules[shape] = ScheduleGPipe(
                self._new_stage(), even_microbatches(shape[0], self.pp)
            )
        schedule = self._eval_schedules[shape]
        return schedule.eval(*self._stage_args(batch), **self._stage_kwargs(batch))

    def sum_over_stages(self, tensor: torch.Tensor) -> None:
        """All-reduce `tensor` (in place) over this process's column of stages: what only the
        last stage computed (evaluation's metric totals) reaches every stage."""
        dist.all_reduce(tensor, group=self._pp_group)

    def share_from_last_stage(
        self, result: torch.Tensor | None, failure: BaseException | None = None
    ) -> torch.Tensor:
        """`result`, computed on the last stage (None on the others), on every stage of this
        process's column: its shape and dtype first (the other stages do not know them: a
        reduction of the logits, llmfoundry/eval/forward.py), then the tensor. A `failure` of
        the last stage's computation is raised on every stage (there, `failure` itself), so
        none waits for a tensor that will not come."""
        last = self.pp - 1
        meta: list[Any] = [None]
        if self.is_last:
            meta = [(tuple(result.shape), result.dtype) if failure is None else repr(failure)]
        dist.broadcast_object_list(meta, group=self._pp_group, group_src=last, device=self._device)
        if isinstance(meta[0], str):
            if failure is not None:
                raise failure
            raise RuntimeError(f"the last pipeline stage failed: {meta[0]}")
        shape, dtype = meta[0]
        if self.is_last:
            tensor = result.to(self._device).contiguous()
        else:
            tensor = torch.empty(shape, dtype=dtype, device=self._device)
        dist.broadcast(tensor, group=self._pp_group, group_src=last)
        return tensor

    def microbatches(self, rows: int, microbatch_size: int | None) -> int:
        """How many microbatches a device batch of `rows` makes (`microbatch_size` None: the
        fewest that keep every stage busy, `default_microbatch_size`); refused if too few for the
        schedule (also checked at launch: llmfoundry/build.py)."""
        microbatch_size = microbatch_size or self.default_microbatch_size(rows)
        n_microbatches = -(-rows // microbatch_size)
        if microbatch_size and rows % microbatch_size:  # buffers: laid out for the first's shape
            raise UserError(
                f"device_train_microbatch_size={microbatch_size} does not divide the {rows} "
                f"samples per device: with parallelism.pp={self.pp} every microbatch must have "
                "the same number of samples; use a divisor of the per-device batch"
            )
        if n_microbatches < self.pp and self.schedule_name in _NEED_PP_MICROBATCHES:
            raise UserError(
                f"parallelism.pp_schedule={self.schedule_name} needs at least pp={self.pp} "
                f"microbatches per step, got {n_microbatches} ({rows} samples per device in "
                f"microbatches of {microbatch_size or rows}): lower "
                "device_train_microbatch_size, raise the batch, or use pp_schedule=gpipe"
            )
        return n_microbatches

    def default_microbatch_size(self, rows: int) -> int:
        """The largest divisor of `rows` that makes at least pp microbatches (every stage busy,
        each microbatch the same shape, the fewest sends); all `rows` when there are fewer than
        pp (then `microbatches` says what to change where the schedule needs pp)."""
        fits = [size for size in range(1, rows + 1) if rows % size == 0 and rows // size >= self.pp]
        return max(fits, default=rows)

    def _schedule(self, n_microbatches: int) -> PipelineScheduleSingle:
        if n_microbatches not in self._schedules:
            self._schedules[n_microbatches] = SCHEDULES[self.schedule_name](
                self._stage,
                n_microbatches,
                loss_fn=lambda outputs, targets: self._loss_fn(outputs, targets),
                scale_grads=False,  # the loss function weights each microbatch itself
            )
        return self._schedules[n_microbatches]

    @torch.no_grad()
    def clip_grad_norm_(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        """`torch.nn.utils.clip_grad_norm_` over the whole model: the L2 norm of every stage's
        gradients (the tied weights counted once, the first stage's), each stage's gradients
        scaled by the same factor; returns the norm (on the device, the same on every stage)."""
        params = [p for p in model.parameters() if p.grad is not None]
        copies = set() if self.is_first else {id(p) for p in self._tied}
        norm = torch.nn.utils.get_total_norm([p.grad for p in params if id(p) not in copies])
        if isinstance(norm, DTensor):  # this stage's shards: its whole norm, on every rank
            norm = norm.full_tensor()
        squared = norm.double().square()
        dist.all_reduce(squared, group=self._pp_group)
        total = squared.sqrt().float()
        scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
        for param in params:
            grad = param.grad
            (grad.to_local() if isinstance(grad, DTensor) else grad).mul_(scale)
        return total

    @torch.no_grad()
    def _sum_tied_gradients(self) -> None:
        for param in self._tied:
            grad = param.grad
            if grad is None:
                grad = param.grad = torch.zeros_like(param)
            local = grad.to_local() if isinstance(grad, DTensor) else grad
            dist.all_reduce(local, group=self._tied_group)


def even_microbatches(rows: int, most: int) -> int:
    """The most microbatches, at most `most`, that split `rows` rows into equal parts (1 for a
    prime number of rows above `most`: one microbatch, the pipeline idle but for one stage)."""
    return max(n for n in range(1, min(rows, most) + 1) if rows % n == 0)


def _replace(model: nn.Module, name: str, module: nn.Module) -> nn.Module:
    """Put `module` at `name` in `model`; returns the module that was there."""
    parent, _, attr = name.rpartition(".")
    owner = model.get_submodule(parent)
    previous = owner.get_submodule(attr)
    setattr(owner, attr, module)
    return previous

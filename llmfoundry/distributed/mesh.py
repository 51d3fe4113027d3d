"""The device mesh: how the training processes divide the work, one axis per kind of parallelism.

As torchtitan's ``ParallelDims``: `ParallelDims` says how many processes each axis spans
(data-parallel replicas `dp_replicate`, data-parallel shards `dp_shard`, context `cp`, tensor
`tp` and pipeline `pp` parallelism), and `build_mesh` lays them out as one ``DeviceMesh`` in the
order pp, dp_replicate, dp_shard, cp, tp (the innermost axis the fastest links).

The mesh is the parallelism config: the `parallelism:` block of conf/train.yaml holds these
numbers, and `parallel_dims` turns it into a ParallelDims, the one function for it (training,
scripts/eval.py and the planner, llmfoundry/planning.py), so that nothing that lays out a mesh
accepts one training refuses. The strategies wrap the data-parallel axes of that mesh: DDP
replicates over them, FSDP shards (and, with dp_replicate > 1, replicates) over them and also
takes the cp, tp and pp axes; DDP and DeepSpeed run the whole model on every process, so they
refuse those (`STRATEGY_AXES`).

Data-parallel ranks read different data; the other axes' ranks of one data-parallel rank read
the same batch. So the trainer counts samples and tokens over the data-parallel group
(`Mesh.dp_group`, `ParallelDims.dp_size`), not over the world. Context-parallel ranks read the
same batch too, but each computes the loss of its own part of every sequence: losses and
gradients are reduced over data-parallel x context-parallel ranks (`Mesh.loss_group`,
`ParallelDims.loss_size`), and FSDP shards parameters over dp_shard x cp (`Mesh.fsdp_mesh`), as
torchtitan does.

Expert parallelism (`ep`) is no axis of its own: as torchtitan's, its ranks are borrowed from
the data-parallel shards (with the context-parallel ranks), whose tokens differ. The dp_shard x
cp ranks are cut into `efsdp` groups of `ep` (`Mesh.ep_mesh`): each of an ep group's ranks
holds 1/ep of every MoE layer's experts, and the group's tokens are sent to the ranks holding
their experts (llmfoundry/distributed/expert.py); FSDP shards the expert weights over the
remaining `efsdp` ranks (`Mesh.expert_fsdp_mesh`) and the other weights over all dp_shard x cp
ranks, as before. Tensor-parallel ranks (the same tokens) run the experts alike.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from llmfoundry.utils.errors import UserError

# Outermost first: a pipeline stage spans nodes, tensor parallelism stays within one.
_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
# `parallelism.pp_schedule` names (llmfoundry/distributed/pipeline.py runs them).
PIPELINE_SCHEDULES = ("1f1b", "gpipe")
_DATA_PARALLEL = ("dp_replicate", "dp_shard")
# The mesh axes each strategy (conf/strategy/<name>.yaml) lays processes out on; the others
# must be 1. DDP and DeepSpeed run the whole model on every process: only data parallelism.
STRATEGY_AXES: dict[str, tuple[str, ...]] = {
    "single": (),
    "ddp": _DATA_PARALLEL,
    "deepspeed_zero1": _DATA_PARALLEL,
    "deepspeed_zero2": _DATA_PARALLEL,
    "deepspeed_zero3": _DATA_PARALLEL,
    "fsdp": (*_ORDER, "ep"),
}


@dataclass(frozen=True)
class ParallelDims:
    """Processes per axis; their product is the world size. `dp_shard=-1`: what the other axes
    leave of the world. `pp_schedule`: how the pipeline axis runs its microbatches (with
    pp > 1). `ep`: expert-parallel ranks, borrowed from dp_shard x cp (it must divide it; see
    the module docstring). Validated on construction (one-line UserErrors)."""

    world_size: int
    dp_replicate: int = 1
    dp_shard: int = -1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    pp_schedule: str = "1f1b"
    ep: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "pp_schedule", check_schedule(self.pp_schedule))
        if self.world_size < 1:
            raise UserError(f"world size {self.world_size} must be at least 1")
        for name in ("dp_replicate", "cp", "tp", "pp", "ep"):
            if getattr(self, name) < 1:
                raise UserError(f"{name}={getattr(self, name)} must be at least 1")
        others = self.dp_replicate * self.cp * self.tp * self.pp
        if self.dp_shard == -1:
            if self.world_size % others:
                raise UserError(
                    f"dp_replicate={self.dp_replicate} x cp={self.cp} x tp={self.tp} x "
                    f"pp={self.pp} = {others} does not divide the {self.world_size} processes"
                )
            object.__setattr__(self, "dp_shard", self.world_size // others)
        elif self.dp_shard < 1:
            raise UserError(f"dp_shard={self.dp_shard} must be at least 1, or -1 (the rest)")
        product = others * self.dp_shard
        if product != self.world_size:
            raise UserError(
                f"dp_replicate={self.dp_replicate} x dp_shard={self.dp_shard} x cp={self.cp} x "
                f"tp={self.tp} x pp={self.pp} = {product}, but there are {self.world_size} "
                "processes"
            )
        if (self.dp_shard * self.cp) % self.ep:
            raise UserError(
                f"ep={self.ep} does not divide dp_shard={self.dp_shard} x cp={self.cp} = "
                f"{self.dp_shard * self.cp}: expert-parallel ranks are borrowed from those; "
                "choose an ep that divides it"
            )

    @property
    def efsdp(self) -> int:
        """How many ranks FSDP shards each expert's weights over: dp_shard x cp / ep (the ranks
        of each ep group's rank in the other groups; 1 when one ep group spans them all)."""
        return self.dp_shard * self.cp // self.ep

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: how many different parts of each global batch are read."""
        return self.dp_replicate * self.dp_shard

    @property
    def dp_is_world(self) -> bool:
        """Whether every process is a data-parallel rank of its own (no cp, tp or pp axis)."""
        return self.dp_size == self.world_size

    @property
    def loss_size(self) -> int:
        """Ranks whose losses cover different tokens of each global batch: the data-parallel
        ranks times the context-parallel ranks of each (the gradient averages over them)."""
        return self.dp_size * self.cp

    def shape(self) -> dict[str, int]:
        """The mesh's axes and sizes, outermost first. cp, tp and pp only when used; dp_shard always
        and dp_replicate whenever it replicates (FSDP shards over a one-axis mesh and replicates
        across the first axis of a two-axis one, so replicas of unsharded models stay 2-D)."""
        return {n: getattr(self, n) for n in _ORDER if n == "dp_shard" or getattr(self, n) > 1}

    def coordinates(self, rank: int) -> dict[str, int]:
        """`rank`'s index on each axis of `shape` (row-major, as DeviceMesh lays ranks out)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the {self.world_size} processes")
        coordinates = {}
        for name, size in reversed(self.shape().items()):
            rank, coordinates[name] = divmod(rank, size)
        return coordinates

    def dp_rank(self, rank: int) -> int:
        """Which data-parallel rank the process `rank` is (what part of the data it reads)."""
        at = self.coordinates(rank)
        return at.get("dp_replicate", 0) * self.dp_shard + at["dp_shard"]

    def cp_rank(self, rank: int) -> int:
        """Which part of each sequence the process `rank` computes (0 without context
        parallelism; `llmfoundry.distributed.context`)."""
        return self.coordinates(rank).get("cp", 0)

    def dp_axes(self) -> tuple[str, ...]:
        """The mesh axes data parallelism spans (replicate across, shard within)."""
        return tuple(n for n in ("dp_replicate", "dp_shard") if n in self.shape())


def check_schedule(name: str) -> str:
    """`name` as `PIPELINE_SCHEDULES` spells it, or a UserError naming the ones there are."""
    if str(name).lower() == "interleaved":  # the planner's name (llmfoundry/planning.py)
        raise UserError(
            "parallelism.pp_schedule=interleaved (1F1B over several stages per process) is not "
            f"supported in training yet; use one of {', '.join(PIPELINE_SCHEDULES)}"
        )
    if str(name).lower() not in PIPELINE_SCHEDULES:
        raise UserError(
            f"parallelism.pp_schedule={name!r}: use one of {', '.join(PIPELINE_SCHEDULES)}"
        )
    return str(name).lower()


# The keys of the config's `parallelism:` block (conf/train.yaml): ParallelDims' fields.
PARALLELISM_KEYS = tuple(f.name for f in fields(ParallelDims) if f.name != "world_size")


def parallel_dims(
    parallelism: Mapping[str, Any] | ParallelDims | None, world_size: int, strategy: str = "fsdp"
) -> ParallelDims:
    """The mesh of the config's `parallelism:` block (None: the defaults, every process a
    data-parallel rank) over `world_size` processes, refused in one line where `strategy` (a
    conf/strategy name) cannot lay it out. Every strategy builds its `dims` with it (and so
    scripts/eval.py's mesh), and so does the planner (llmfoundry/planning.py), so none accepts
    a mesh training refuses. A ParallelDims is taken as it is (laid out for `world_size`
    processes)."""
    if isinstance(parallelism, ParallelDims):
        refuse_axes(dataclasses.asdict(parallelism), strategy, world_size)
        if parallelism.world_size != world_size:
            raise UserError(
                f"the parallelism is laid out for {parallelism.world_size} processes, but there "
                f"are {world_size}"
            )
        return parallelism
    given = dict(parallelism or {})
    unknown = sorted(set(given) - set(PARALLELISM_KEYS))
    if unknown:
        raise UserError(f"parallelism.{unknown[0]}: unknown key; use {', '.join(PARALLELISM_KEYS)}")
    for key, value in given.items():
        if key != "pp_schedule" and (isinstance(value, bool) or not isinstance(value, int)):
            raise UserError(f"parallelism.{key}={value!r} must be an integer")
    refuse_axes(given, strategy, world_size)
    try:
        return ParallelDims(world_size, **given)
    except UserError as err:
        raise UserError(f"parallelism: {err}") from None


def refuse_axes(sizes: Mapping[str, Any], strategy: str, world_size: int | None = None) -> None:
    """A UserError naming the first axis of `sizes` (the parallelism block's) that `strategy`
    cannot lay processes out on (`STRATEGY_AXES`), and the strategy that can; `world_size`
    (None: not known yet, as when a config is checked before launch) for what depends on it."""
    axes = STRATEGY_AXES.get(strategy, _ORDER)
    kinds = {"cp": "context", "tp": "tensor", "pp": "pipeline", "ep": "expert"}
    for axis, kind in kinds.items():
        size = sizes.get(axis, 1)
        if size != 1 and axis not in axes:
            raise UserError(
                f"parallelism.{axis}={size}: strategy={strategy} runs the whole model on every "
                f"process, without {kind} parallelism; use strategy=fsdp, or {axis}=1"
            )
    if not axes and world_size is not None and world_size > 1:
        raise UserError(
            f"strategy={strategy} runs one process, but there are {world_size}: use "
            "strategy=ddp or strategy=fsdp"
        )
    replicate = sizes.get("dp_replicate", 1)
    hybrid = world_size is not None and replicate not in (1, world_size)
    if axes and strategy != "fsdp" and hybrid:
        raise UserError(
            f"parallelism.dp_replicate={replicate}: strategy={strategy} lays its data-parallel "
            "ranks out on one axis (hybrid sharding is FSDP's); use strategy=fsdp, or leave "
            "dp_replicate at 1"
        )


def sequence_multiple(dims: ParallelDims) -> int:
    """What every training sequence's length must be a multiple of: tensor (sequence)
    parallelism splits it over tp ranks, context parallelism into 2 x cp chunks (each cp rank
    holds two: llmfoundry/distributed/context.py), and each of those over the tp ranks."""
    return dims.tp * (2 * dims.cp if dims.cp > 1 else 1)


def check_sequence_length(dims: ParallelDims, seq_len: int, setting: str = "max_seq_len") -> None:
    """Refuse, before any process waits on another, a training length the mesh cannot split
    (`sequence_multiple`)."""
    multiple = sequence_multiple(dims)
    if seq_len % multiple:
        parts = [f"tp={dims.tp}"] * (dims.tp > 1) + [f"2 x cp={dims.cp}"] * (dims.cp > 1)
        raise UserError(
            f"{setting}={seq_len} is not a multiple of {multiple} ({' x '.join(parts)}): the "
            f"mesh splits every sequence into that many parts; choose a {setting} that is one"
        )


@dataclass(frozen=True)
class Mesh:
    """`dims` laid out over the joined process group (`build_mesh`). `dp_group`: the processes
    this one counts samples and tokens with; `loss_group`: those it reduces losses and
    gradients with (the data-parallel x context-parallel ranks: different tokens); None when
    that is every process (the default group, so nothing new is created). `ep_mesh` and
    `expert_fsdp_mesh`: the expert-parallel ranks and those FSDP shards experts over, with
    `dims.ep` > 1 (`expert_meshes`)."""

    dims: ParallelDims
    device_mesh: DeviceMesh
    dp_group: dist.ProcessGroup | None
    loss_group: dist.ProcessGroup | None = None
    # dp_shard and cp flattened into one axis (`fsdp_mesh`); None without cp.
    dp_shard_cp: DeviceMesh | None = None
    ep_mesh: DeviceMesh | None = None
    expert_fsdp_mesh: DeviceMesh | None = None

    @property
    def dp_mesh(self) -> DeviceMesh:
        """The data-parallel axes alone: what DDP replicates over, and what reads the data."""
        return self.device_mesh[self.dims.dp_axes()]

    @property
    def fsdp_mesh(self) -> DeviceMesh:
        """What FSDP shards and replicates parameters over: the data-parallel axes, with the
        context-parallel axis joined to dp_shard (`dp_shard_cp`) when there is one, since those
        ranks' gradients (of different tokens) are averaged as data-parallel ranks' are."""
        if self.dp_shard_cp is None:
            return self.dp_mesh
        if self.dims.dp_replicate > 1:
            return self.device_mesh["dp_replicate", "dp_shard_cp"]
        return self.dp_shard_cp  # kept from its flattening: torch warns on slicing it again

    @property
    def cp_mesh(self) -> DeviceMesh | None:
        """The context-parallel axis: the ranks that split each sequence; None without one."""
        return self.device_mesh["cp"] if self.dims.cp > 1 else None


def build_mesh(dims: ParallelDims, device_type: str) -> Mesh:
    """The `DeviceMesh` of `dims` over the initialized default process group (of `dims.world_size`
    processes), and its data-parallel group."""
    if dist.get_world_size() != dims.world_size:
        raise RuntimeError(
            f"the mesh is for {dims.world_size} processes but the process group has "
            f"{dist.get_world_size()}"
        )
    shape = dims.shape()
    device_mesh = init_device_mesh(device_type, tuple(shape.values()), mesh_dim_names=tuple(shape))
    if "tp" in shape:
        # FSDP over tp: the parameters are DTensors sharded on both axes, and a reduction over
        # them (the gradient norm) runs as one all-reduce where DTensor finds this flattened
        # mesh; without it, one per axis, and every rank warns that this is "suboptimal".
        device_mesh["dp_shard", "tp"]._flatten("dp_shard_tp")
    dp_group = None if dims.dp_is_world else _flat_group(device_mesh, dims.dp_axes(), "dp")
    if dims.cp == 1:
        return Mesh(dims, device_mesh, dp_group, dp_group, None, *expert_meshes(device_mesh, dims))
    dp_shard_cp = device_mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    if "tp" in shape:  # FSDP shards over dp_shard x cp then: the same, for its norm
        device_mesh["dp_shard", "cp", "tp"]._flatten("dp_shard_cp_tp")
    loss_group = None
    if dims.loss_size != dims.world_size:
        loss_group = (
            device_mesh["dp_replicate", "dp_shard_cp"]._flatten("dp_cp").get_group()
            if dims.dp_replicate > 1
            else dp_shard_cp.get_group()
        )
    experts = expert_meshes(device_mesh, dims, dp_shard_cp)
    return Mesh(dims, device_mesh, dp_group, loss_group, dp_shard_cp, *experts)


def expert_meshes(
    device_mesh: DeviceMesh, dims: ParallelDims, dp_shard_cp: DeviceMesh | None = None
) -> tuple[DeviceMesh | None, DeviceMesh | None]:
    """(the ep axis, what FSDP shards experts over) of `device_mesh`; (None, None) at ep=1. The
    dp_shard x cp ranks (`dp_shard_cp`, flattened; dp_shard alone without cp) are unflattened
    into efsdp x ep, ep innermost (an ep group's ranks are neighbours: its all-to-alls stay on
    the fastest links). Both stay slices of `device_mesh`, as FSDP needs to shard the ep-sharded
    expert weights again (over efsdp, and across dp_replicate's replicas)."""
    if dims.ep == 1:
        return None, None
    joined = device_mesh["dp_shard"] if dp_shard_cp is None else dp_shard_cp
    sparse = joined._unflatten(0, (dims.efsdp, dims.ep), ("efsdp", "ep"))  # no public one (2.13)
    fsdp = sparse["efsdp"]
    if dims.dp_replicate > 1:
        fsdp = DeviceMesh._concatenate([device_mesh["dp_replicate"], fsdp])
    return sparse["ep"], fsdp


def _flat_group(device_mesh: DeviceMesh, axes: tuple[str, ...], name: str) -> dist.ProcessGroup:
    """The process group of `axes` of `device_mesh` taken as one (flattened as `name`)."""
    mesh = device_mesh[axes]
    if len(axes) > 1:
        mesh = mesh._flatten(name)  # torch has no public flatten (2.13)
    return mesh.get_group()

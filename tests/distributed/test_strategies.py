"""Strategy checks that need no second process: bad settings fail early with a clear message."""

import dataclasses
import re
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from torch.utils._python_dispatch import TorchDispatchMode

from llmfoundry.build import build_strategy, per_rank_batch
from llmfoundry.data.streaming import World
from llmfoundry.distributed import DDP, FSDP, ParallelDims, SingleDevice
from llmfoundry.distributed.parallelize import apply_plan, checkpoint_blocks
from llmfoundry.models import parallel_plan
from tests.trainer.conftest import tiny_model


def test_a_batch_the_data_parallel_size_does_not_divide_names_the_nearest_sizes():
    assert per_rank_batch(12, 4) == 3
    with pytest.raises(
        ValueError, match=r"global_train_batch_size=10 .* 4 data-parallel .*8 or 12"
    ):
        per_rank_batch(10, 4)
    with pytest.raises(ValueError, match=r"use 8$"):
        per_rank_batch(3, 8)


@pytest.fixture
def torchrun_env(monkeypatch):
    for key, value in dict(
        RANK="0", WORLD_SIZE="4", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="1"
    ).items():
        monkeypatch.setenv(key, value)


REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("overrides", "dims"),
    [
        (["strategy=fsdp"], ParallelDims(4, dp_shard=4)),
        (["strategy=fsdp", "parallelism.dp_replicate=2"], ParallelDims(4, dp_replicate=2, dp_shard=2)),
        (["strategy=fsdp", "strategy.replicate=2"], ParallelDims(4, dp_replicate=2, dp_shard=2)),
        (["strategy=fsdp", "parallelism.tp=2", "parallelism.pp=2", "parallelism.pp_schedule=gpipe"],
         ParallelDims(4, dp_shard=1, tp=2, pp=2, pp_schedule="gpipe")),
        (["strategy=ddp"], ParallelDims(4, dp_replicate=4, dp_shard=1)),
        (["strategy=deepspeed_zero2"], ParallelDims(4, dp_shard=4)),
    ],
)  # fmt: skip
def test_the_strategy_configs_lay_their_processes_out_on_the_mesh(torchrun_env, overrides, dims):
    with initialize_config_dir(str(REPO / "conf"), version_base=None):
        cfg = compose("train", overrides=[*overrides, "strategy.device=cpu"])
    strategy = build_strategy(cfg)
    assert strategy.dims == dims
    assert strategy.dp_size == dims.dp_size and strategy.dp_rank == 0
    assert (strategy.tp, strategy.pp, strategy.pipeline is not None) == (
        dims.tp,
        dims.pp,
        dims.pp > 1,
    )


@pytest.mark.parametrize(
    ("strategy", "parallelism", "message"),
    [
        (DDP, {"tp": 2}, "parallelism.tp=2: strategy=ddp runs the whole model on every process"),
        (DDP, {"dp_replicate": 2}, "parallelism.dp_replicate=2: strategy=ddp lays its data-"),
        (SingleDevice, {"pp": 2}, "parallelism.pp=2: strategy=single runs the whole model"),
        (FSDP, {"dp_replicate": 3}, "parallelism: dp_replicate=3 x cp=1 x tp=1 x pp=1 = 3 does not "
         "divide the 4 processes"),
        (FSDP, {"tp": "2"}, "parallelism.tp='2' must be an integer"),
        (FSDP, {"pp": 2, "pp_schedule": "zigzag"}, "parallelism.pp_schedule='zigzag': use one of"),
        (FSDP, ParallelDims(8), "laid out for 8 processes, but there are 4"),
    ],
)  # fmt: skip
def test_a_strategy_refuses_a_mesh_it_cannot_take_in_one_line(
    torchrun_env, strategy, parallelism, message
):
    with pytest.raises(ValueError, match=re.escape(message)) as err:
        strategy("cpu", parallelism=parallelism)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"activation_checkpointing": "some"}, "'none', 'full', 'selective' or a positive"),
        ({"activation_checkpointing": 0}, "'none', 'full', 'selective' or a positive"),
        ({"mixed_precision": "fp16"}, "use null"),
    ],
)
def test_fsdp_refuses_bad_options(torchrun_env, options, message):
    with pytest.raises(ValueError, match=message):
        FSDP("cpu", **options)


def test_fsdp_needs_torchrun(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(ValueError, match="strategy=fsdp needs the torchrun environment"):
        FSDP("cpu")


def test_the_mpt_plan_names_its_blocks_and_other_models_have_none():
    model = tiny_model()
    assert parallel_plan(model).blocks == list(model.transformer.blocks)
    with pytest.raises(ValueError, match="no parallelization plan for Linear"):
        parallel_plan(torch.nn.Linear(2, 2))


def test_the_data_partition_comes_from_the_strategy_not_the_environment(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    world = World.detect((1, 2))
    assert (world.rank, world.world_size) == (1, 2)
    assert (World.detect().rank, World.detect().world_size) == (0, 4)
    with pytest.raises(ValueError, match=r"RANK=2 must be in \[0, WORLD_SIZE=2\)"):
        World.detect((2, 2))


class CountOps(TorchDispatchMode):
    """How many times each aten op ran (ops that selective checkpointing replays from what it
    saved never reach this mode)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        name = func.overloadpacket.__name__
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def backward_ops(mode: str) -> dict[str, int]:
    model = tiny_model()
    model = type(model)(dataclasses.replace(model.config, init_device="cpu"))
    every, selective = {"none": (0, False), "full": (1, False), "selective": (1, True)}[mode]
    checkpoint_blocks(list(model.transformer.blocks), every, selective)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    loss = model.loss(model(ids), ids)
    with CountOps() as ops:
        loss.backward()
    return ops.counts


def test_selective_activation_checkpointing_recomputes_all_but_the_matmuls():
    plain, full, selective = (backward_ops(m) for m in ("none", "full", "selective"))
    matmuls = ("mm", "addmm", "bmm", "baddbmm")

    def count(ops, names):
        return sum(ops.get(name, 0) for name in names)

    # Full checkpointing runs each block's forward again in backward, matmuls included ...
    assert count(full, matmuls) > count(plain, matmuls)
    # ... selective keeps the matmuls' outputs: backward multiplies exactly as without
    # checkpointing, and recomputes the rest (layer norms here).
    assert count(selective, matmuls) == count(plain, matmuls)
    norms = [name for name in full if "layer_norm" in name]
    assert norms and count(selective, norms) == count(full, norms) > count(plain, norms)


def test_selective_activation_checkpointing_keeps_the_attention_output():
    """The fused attention op (on CPU sdpa's flash kernel) is a block's costliest after the
    matmuls, and its backward needs its output: selective checkpointing saves it, as
    torchtitan does, so backward never runs the attention forward again (full does)."""
    plain, full, selective = (backward_ops(m) for m in ("none", "full", "selective"))
    forward, backward = (
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_flash_attention_for_cpu_backward",
    )
    assert plain.get(forward, 0) == 0 and full[forward] == 2  # one per block, recomputed
    assert selective.get(forward, 0) == 0
    assert selective[backward] == full[backward] == plain[backward] == 2


def test_blocks_are_compiled_by_the_strategy_after_activation_checkpointing():
    """The model only records `compile`; preparing applies it, to the plan's blocks, after
    activation checkpointing has wrapped their forward (torch.compile traces it lazily)."""
    model = tiny_model(compile=True)
    assert all(block._compiled_call_impl is None for block in model.transformer.blocks)
    plan = apply_plan(model, "full")
    assert plan.compile and plan.blocks == list(model.transformer.blocks)
    for block in plan.blocks:
        assert block._compiled_call_impl is not None
        assert block.forward.func is torch.utils.checkpoint.checkpoint
    prepared = SingleDevice("cpu").prepare(tiny_model(compile=True))
    assert all(b._compiled_call_impl is not None for b in prepared.transformer.blocks)
    assert apply_plan(torch.nn.Linear(2, 2)) is None  # no family: nothing to apply
    with pytest.raises(ValueError, match="no parallelization plan for Linear"):
        apply_plan(torch.nn.Linear(2, 2), "full")

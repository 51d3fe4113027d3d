"""The device mesh: axis sizes validated against the world, ranks placed on it, and the
data-parallel group that the trainer reduces over (one process, torch's fake process group
standing in for the others)."""

import pytest
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from llmfoundry.distributed.mesh import (
    ParallelDims,
    build_mesh,
    check_sequence_length,
    parallel_dims,
    refuse_axes,
    sequence_multiple,
)
from llmfoundry.utils.errors import UserError


@pytest.mark.parametrize(
    ("dims", "message"),
    [
        (
            {"world_size": 4, "dp_replicate": 3},
            "dp_replicate=3 x cp=1 x tp=1 x pp=1 = 3 does not divide",
        ),
        ({"world_size": 4, "dp_shard": 3}, "= 3, but there are 4 processes"),
        ({"world_size": 8, "dp_shard": 2, "tp": 2}, "= 4, but there are 8 processes"),
        ({"world_size": 4, "tp": 0}, "tp=0 must be at least 1"),
        ({"world_size": 4, "cp": 0}, "cp=0 must be at least 1"),
        ({"world_size": 8, "cp": 3}, "cp=3 x tp=1 x pp=1 = 3 does not divide"),
        ({"world_size": 4, "dp_shard": 0}, r"dp_shard=0 must be at least 1, or -1"),
        ({"world_size": 4, "ep": 0}, "ep=0 must be at least 1"),
        ({"world_size": 8, "tp": 2, "ep": 3}, r"^ep=3 does not divide dp_shard=4 x cp=1 = 4: "),
        ({"world_size": 8, "tp": 4, "cp": 2, "ep": 4}, "ep=4 does not divide dp_shard=1 x cp=2"),
    ],
)
def test_impossible_products_are_refused_in_one_line(dims, message):
    with pytest.raises(UserError, match=message) as err:
        ParallelDims(**dims)
    assert "\n" not in str(err.value)


def test_dp_shard_takes_what_the_other_axes_leave():
    dims = ParallelDims(16, dp_replicate=2, tp=2)
    assert (dims.dp_shard, dims.dp_size, dims.dp_is_world) == (4, 8, False)
    assert dims.shape() == {"dp_replicate": 2, "dp_shard": 4, "tp": 2}
    # DDP keeps a replicate axis of its own; plain sharding is one axis.
    assert ParallelDims(4, dp_replicate=4, dp_shard=1).shape() == {"dp_replicate": 4, "dp_shard": 1}
    assert ParallelDims(4).shape() == {"dp_shard": 4}


def test_ranks_of_one_tensor_parallel_group_are_one_data_parallel_rank():
    dims = ParallelDims(8, dp_replicate=2, tp=2)  # tp innermost: ranks 2k, 2k+1 read one batch
    assert [dims.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [ParallelDims(4).dp_rank(r) for r in range(4)] == [0, 1, 2, 3]


@pytest.fixture
def fake_world():
    """Rank 5 of 8 processes, without the other seven (collectives do nothing)."""
    dist.init_process_group("fake", store=FakeStore(), rank=5, world_size=8)
    yield
    dist.destroy_process_group()


def test_the_mesh_gives_the_data_parallel_group_across_the_other_axes(fake_world):
    mesh = build_mesh(ParallelDims(8, dp_replicate=2, tp=2), "cpu")
    assert mesh.device_mesh.mesh_dim_names == ("dp_replicate", "dp_shard", "tp")
    assert mesh.dp_mesh.mesh_dim_names == ("dp_replicate", "dp_shard")
    assert dist.get_process_group_ranks(mesh.dp_group) == [1, 3, 5, 7]
    assert dist.get_rank(mesh.dp_group) == ParallelDims(8, dp_replicate=2, tp=2).dp_rank(5)


def test_context_parallel_ranks_read_one_batch_but_reduce_losses_and_shard_parameters(fake_world):
    dims = ParallelDims(8, dp_replicate=2, cp=2)  # cp inside dp_shard: ranks 2k, 2k+1 split one
    assert [dims.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [dims.cp_rank(r) for r in range(8)] == [0, 1] * 4
    assert (dims.dp_size, dims.loss_size) == (4, 8)
    mesh = build_mesh(dims, "cpu")
    assert mesh.device_mesh.mesh_dim_names == ("dp_replicate", "dp_shard", "cp")
    assert dist.get_process_group_ranks(mesh.dp_group) == [1, 3, 5, 7]
    assert mesh.loss_group is None  # every process holds different tokens
    assert mesh.fsdp_mesh.mesh_dim_names == ("dp_replicate", "dp_shard_cp")
    assert mesh.fsdp_mesh.shape == (2, 4)
    assert dist.get_process_group_ranks(mesh.cp_mesh.get_group()) == [4, 5]


def test_with_tensor_parallelism_the_loss_group_leaves_out_the_tp_ranks(fake_world):
    mesh = build_mesh(ParallelDims(8, cp=2, tp=2), "cpu")
    assert mesh.device_mesh.mesh_dim_names == ("dp_shard", "cp", "tp")
    assert dist.get_process_group_ranks(mesh.loss_group) == [1, 3, 5, 7]
    assert dist.get_process_group_ranks(mesh.dp_group) == [1, 5]


def test_expert_parallel_ranks_are_borrowed_from_dp_shard_x_cp(fake_world):
    """ep cuts the dp_shard x cp ranks into efsdp groups of ep neighbours: the world mesh is
    unchanged (ep is no axis of it), rank 5 holds its experts with rank 4 and shards them with
    the ranks at its place in the other ep groups; tp ranks (the same tokens) are in none."""
    dims = ParallelDims(8, cp=2, ep=4)  # dp_shard 4 x cp 2 = 8 = efsdp 2 x ep 4
    assert (dims.efsdp, dims.shape()) == (2, {"dp_shard": 4, "cp": 2})
    mesh = build_mesh(dims, "cpu")
    assert dist.get_process_group_ranks(mesh.ep_mesh.get_group()) == [4, 5, 6, 7]
    assert dist.get_process_group_ranks(mesh.expert_fsdp_mesh.get_group()) == [1, 5]
    mesh = build_mesh(ParallelDims(8, dp_replicate=2, tp=2, ep=2), "cpu")
    assert dist.get_process_group_ranks(mesh.ep_mesh.get_group()) == [5, 7]
    assert mesh.expert_fsdp_mesh.mesh_dim_names == ("dp_replicate", "efsdp")
    assert mesh.expert_fsdp_mesh.shape == (2, 1)  # replicated across dp_replicate (HSDP)
    assert build_mesh(ParallelDims(8), "cpu").ep_mesh is None


def test_without_other_axes_the_data_parallel_group_is_the_world(fake_world):
    mesh = build_mesh(ParallelDims(8, dp_replicate=2), "cpu")
    assert mesh.dp_group is None  # the default group: no new one created
    assert mesh.dp_mesh.shape == (2, 4)
    with pytest.raises(RuntimeError, match="mesh is for 4 processes but the process group has 8"):
        build_mesh(ParallelDims(4), "cpu")


def test_the_parallelism_block_becomes_the_dims_every_caller_uses():
    dims = parallel_dims({"dp_replicate": 2, "tp": 2, "pp_schedule": "GPipe"}, 8)
    assert dims == ParallelDims(8, dp_replicate=2, dp_shard=2, tp=2, pp_schedule="gpipe")
    assert parallel_dims(None, 4) == ParallelDims(4) and parallel_dims(dims, 8) is dims
    with pytest.raises(UserError, match=r"^parallelism.tpp: unknown key; use dp_replicate, "):
        parallel_dims({"tpp": 2}, 4)
    # Refused before the product is checked: the strategy, not the arithmetic, is what is wrong.
    with pytest.raises(UserError, match=r"^parallelism.tp=3: strategy=ddp runs the whole model"):
        parallel_dims({"tp": 3}, 4, "ddp")
    refuse_axes({"dp_replicate": 2}, "ddp")  # the world size is not known yet: no verdict
    for strategy in ("ddp", "deepspeed_zero3"):
        with pytest.raises(UserError, match=rf"^parallelism.ep=2: strategy={strategy} runs .*"
                           "without expert parallelism; use strategy=fsdp, or ep=1$"):  # fmt: skip
            parallel_dims({"ep": 2}, 4, strategy)
    assert parallel_dims({"ep": 2}, 4).ep == 2


def test_sequences_are_a_multiple_of_what_the_mesh_splits_them_into():
    assert [
        sequence_multiple(ParallelDims(8, tp=t, cp=c)) for t, c in ((1, 1), (2, 1), (2, 2))
    ] == [
        1,
        2,
        8,
    ]
    check_sequence_length(ParallelDims(8, tp=2, cp=2), 24)
    with pytest.raises(
        UserError, match=r"^max_seq_len=20 is not a multiple of 8 \(tp=2 x 2 x cp=2\)"
    ):
        check_sequence_length(ParallelDims(8, tp=2, cp=2), 20)

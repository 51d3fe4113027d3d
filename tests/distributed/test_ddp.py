"""DDP on CPU (gloo) with two processes: equals one process on the whole batch; auto-microbatching
agrees across ranks when only one of them runs out of memory."""

import functools

import pytest
import torch

from llmfoundry.distributed import DDP, SingleDevice, ddp
from llmfoundry.distributed.base import materialize
from llmfoundry.trainer import Trainer
from tests.trainer.conftest import tiny_model

from .spawn import free_port, run_ranks
from .workers import global_batches, train_rank

WORLD = 2


def run_two_ranks(tmp_path, microbatch, limit_s=180):
    """Spawn the two ranks; a hang (ranks waiting on each other) fails the test, never CI."""
    run_ranks(train_rank, WORLD, free_port(), str(tmp_path), microbatch, limit_s=limit_s)
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]


def single_process_reference(tmp_path):
    batches = global_batches()
    trainer = Trainer(
        model=tiny_model(),
        strategy=SingleDevice("cpu"),
        train_dataloader=batches,
        max_duration=f"{len(batches)}ba",
        optimizer=functools.partial(torch.optim.SGD, lr=0.1),
        run_dir=tmp_path,
    )
    return trainer.fit()


def assert_matches_reference(result, reference):
    params = dict(reference.model.named_parameters())
    for name, value in result["params"].items():
        torch.testing.assert_close(value, params[name].detach(), rtol=1e-5, atol=1e-6, msg=name)
    assert result["train_loss"].item() == pytest.approx(reference.train_loss, rel=1e-6)


def test_two_ranks_equal_one_process_on_the_whole_batch(tmp_path):
    # One sample per microbatch: gradients stay local (no_sync) until the last microbatch.
    results = run_two_ranks(tmp_path, microbatch=1)
    reference = single_process_reference(tmp_path)
    for result in results:
        assert_matches_reference(result, reference)
        assert result["group_destroyed"].item()
    for name, value in results[0]["params"].items():
        assert torch.equal(value, results[1]["params"][name]), name


def test_auto_microbatching_agrees_when_one_rank_runs_out_of_memory(tmp_path):
    results = run_two_ranks(tmp_path, microbatch="auto")
    # Rank 1 fails at 2 samples; rank 0 never fails itself, yet halves with it.
    assert [r["raised"].item() for r in results] == [0, 1]
    assert [r["microbatch"].item() for r in results] == [1, 1]
    for name, value in results[0]["params"].items():
        assert torch.equal(value, results[1]["params"][name]), name
    reference = single_process_reference(tmp_path)
    for result in results:
        assert_matches_reference(result, reference)


def test_ddp_outside_torchrun_says_how_to_launch(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(ValueError, match="torchrun --nproc_per_node"):
        DDP(device="cpu")


def test_ddp_reads_rank_and_picks_gloo_on_cpu(monkeypatch):
    env = {
        "RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "1",
        "MASTER_ADDR": "x",
        "MASTER_PORT": "1",
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    strategy = DDP(device="cpu")
    assert (strategy.rank, strategy.world_size, strategy.backend) == (1, 2, "gloo")
    assert strategy.device == torch.device("cpu")
    monkeypatch.setenv("RANK", "2")
    with pytest.raises(ValueError, match="outside WORLD_SIZE"):
        DDP(device="cpu")


class SumOfTwoRanks:
    """torch.distributed.all_reduce as a second rank holding the same gradients would answer
    (their sum: twice each), recording each call's dtype and size."""

    def __init__(self) -> None:
        self.calls: list[tuple[torch.dtype, int]] = []

    def __call__(self, tensor, op=None, group=None, async_op=False):
        self.calls.append((tensor.dtype, tensor.numel()))
        tensor.mul_(2)
        return self

    def wait(self) -> bool:
        return True


def test_the_deferred_gradient_average_reduces_buckets_not_parameters(monkeypatch):
    """Auto-microbatching averages gradients once every rank has finished its backward
    (`DDP.sync_gradients`): one all-reduce per bucket of a dtype, not one per parameter."""
    for key, value in dict(
        RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="x", MASTER_PORT="1"
    ).items():
        monkeypatch.setenv(key, value)
    all_reduce = SumOfTwoRanks()
    monkeypatch.setattr(ddp.dist, "all_reduce", all_reduce)
    model = materialize(tiny_model(), torch.device("cpu"))
    unused = torch.nn.Parameter(torch.ones(3))  # no gradient on this rank: it sends zeros
    model.register_parameter("unused", unused)
    model.transformer.norm_f.to(torch.bfloat16)  # a second dtype: a bucket of its own
    grads = {name: torch.randn_like(p) for name, p in model.named_parameters() if p is not unused}
    for name, param in model.named_parameters():
        param.grad = grads[name].clone() if name in grads else None
    DDP(device="cpu").sync_gradients(model)
    for name, param in model.named_parameters():
        assert torch.equal(param.grad, grads.get(name, torch.zeros(3))), name  # (2 g) / 2
    numels = {dtype: sum(p.numel() for p in model.parameters() if p.dtype == dtype)
              for dtype in (torch.float32, torch.bfloat16)}  # fmt: skip
    # Two calls, one per dtype, where one per parameter made 15.
    assert sorted(all_reduce.calls, key=str) == sorted(numels.items(), key=str)
    # Buckets hold at most BUCKET_BYTES (a larger gradient alone), in parameter order.
    all_reduce.calls.clear()
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    monkeypatch.setattr(ddp, "BUCKET_BYTES", largest)
    DDP(device="cpu").sync_gradients(model)
    assert 2 < len(all_reduce.calls) < len(list(model.parameters()))
    assert all(n * dtype.itemsize <= largest for dtype, n in all_reduce.calls)

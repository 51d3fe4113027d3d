"""The chunked next-token cross-entropy equals F.cross_entropy, value and gradient; its chunks are
sized for the device (kernel launches per step); evaluation's per-position scores."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from llmfoundry.core import loss as loss_module
from llmfoundry.core.loss import next_token_loss_sum


def reference(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    flat = logits[:, :-1].flatten(0, 1).float()
    return F.cross_entropy(flat, labels[:, 1:].flatten(), ignore_index=-100, reduction="sum")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_elements", [64, 1 << 20])  # many chunks (ragged last) / one
def test_value_and_gradient_match_cross_entropy(monkeypatch, dtype, chunk_elements):
    monkeypatch.setattr(loss_module, "CPU_CHUNK_ELEMENTS", chunk_elements)
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 7, 11, generator=gen) * 3).to(dtype)
    labels = torch.randint(0, 11, (3, 7), generator=gen)
    labels[1, 2:5] = -100
    grad_out = torch.tensor(0.37)
    got_in = logits.clone().requires_grad_()
    want_in = logits.clone().requires_grad_()
    got, want = next_token_loss_sum(got_in, labels), reference(want_in, labels)
    (got * grad_out).backward()
    assert torch.equal(got_in.detach(), logits)  # the logits are left as they were
    (want * grad_out).backward()
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want)
    assert got_in.grad.dtype == dtype
    tol = {"atol": 1e-6, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 4e-3, "rtol": 2e-2}
    torch.testing.assert_close(got_in.grad.float(), want_in.grad.float(), **tol)
    assert got_in.grad[:, -1].abs().sum() == 0  # the last position has no next token
    assert got_in.grad[1, 1:4].abs().sum() == 0  # positions whose next label is ignored


def test_all_ignored_gives_zero_and_zero_gradient():
    logits = torch.randn(2, 4, 5, requires_grad=True)
    total = next_token_loss_sum(logits, torch.full((2, 4), -100))
    total.backward()
    assert total.item() == 0.0 and logits.grad.abs().sum() == 0


# Dispatched ops that launch no kernel: allocations and dtype arithmetic (views are told apart
# by their schema).
_NO_KERNEL = {"empty", "empty_like", "empty_strided", "promote_types"}


class _LaunchCount(TorchDispatchMode):
    """Counts the aten ops dispatched that would launch a kernel on a GPU."""

    def __init__(self) -> None:
        super().__init__()
        self.launches = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and func.overloadpacket.__name__ not in _NO_KERNEL:
            self.launches += 1
        return func(*args, **(kwargs or {}))


def launches(batch: int, seq: int, vocab: int, device: str) -> int:
    logits = torch.empty(batch, seq, vocab, dtype=torch.bfloat16, device=device)
    logits.requires_grad_()
    labels = torch.zeros(batch, seq, dtype=torch.long, device=device)
    with _LaunchCount() as count:
        next_token_loss_sum(logits, labels).backward()
    return count.launches


MPT_VOCAB, LLAMA3_VOCAB = 50368, 128256


def test_a_gpu_step_reads_the_logits_in_chunks_sized_for_the_device_not_a_cpu_cache():
    """mpt-125m's step (16 x 2048 tokens): the CPU's cache-sized chunks (20 rows) would be 1,639
    chunks of ~12 launches each, ~20k launches of microsecond kernels; on a GPU a chunk holds
    at least 2^26 logits, so each kernel streams enough to outlast its launch."""
    tokens = 16 * 2048
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert loss_module.rows_per_chunk(MPT_VOCAB, cpu) == 20
    assert loss_module.rows_per_chunk(LLAMA3_VOCAB, cpu) == 8
    assert loss_module.rows_per_chunk(MPT_VOCAB, cuda) == 1332
    assert loss_module.rows_per_chunk(LLAMA3_VOCAB, cuda) == 523
    assert math.ceil(tokens / loss_module.rows_per_chunk(MPT_VOCAB, cpu)) == 1639
    assert math.ceil(tokens / loss_module.rows_per_chunk(MPT_VOCAB, cuda)) == 25


def test_launches_per_step_on_a_device_grow_with_the_bytes_not_the_rows():
    """Kernels a forward and backward would launch at full size, counted on meta tensors (no
    memory; any device but the CPU is sized as a GPU): one chunk, so the same launches, for 1
    to 1,332 tokens; 25 chunks (about 320 launches) for mpt-125m's 32,768 tokens, where the
    CPU's chunks would launch about 20,000."""
    one_row, one_chunk = launches(1, 1, MPT_VOCAB, "meta"), launches(1, 1332, MPT_VOCAB, "meta")
    assert one_row == one_chunk < 40
    per_chunk = launches(2, 1332, MPT_VOCAB, "meta") - one_chunk
    assert per_chunk == 12  # each chunk's kernels: 8 in forward, 4 in backward
    assert launches(16, 2048, MPT_VOCAB, "meta") == one_chunk + 24 * per_chunk
    assert launches(8, 8192, LLAMA3_VOCAB, "meta") == one_chunk + 125 * per_chunk


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scores_are_cross_entropy_and_argmax_of_each_position(monkeypatch, dtype):
    """Evaluation's per-position loss and prediction, over several chunks (a ragged last one):
    the loss is F.cross_entropy of the float32 logits, the prediction their argmax (the first
    of tied maxima), ignored and last positions score 0."""
    monkeypatch.setattr(loss_module, "CPU_CHUNK_ELEMENTS", 64)
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(3, 7, 11, generator=gen) * 3).to(dtype)
    logits[0, 3, [2, 5]] = 40.0  # a tie: the first wins
    labels = torch.randint(0, 11, (3, 7), generator=gen)
    labels[1, 2:5] = -100
    losses, predicted = loss_module.next_token_scores(logits, labels)
    assert losses.dtype == torch.float32 and predicted.dtype == torch.long
    want = F.cross_entropy(
        logits[:, :-1].float().transpose(1, 2), labels[:, 1:], ignore_index=-100, reduction="none"
    )
    torch.testing.assert_close(losses[:, :-1], want)
    assert losses[:, -1].abs().sum() == 0 and losses[1, 1:4].abs().sum() == 0
    assert torch.equal(predicted, logits.float().argmax(-1)) and predicted[0, 3] == 2


@pytest.mark.cuda
def test_on_the_gpu_a_step_launches_a_few_hundred_kernels_and_matches_cross_entropy():
    """mpt-125m's step (16 x 2048 tokens, bf16 logits) on the GPU: the value and gradient of
    F.cross_entropy of the float32 logits, in 25 chunks: a few hundred kernel launches (the
    CPU's chunks would launch about 20,000)."""
    gen = torch.Generator("cuda").manual_seed(0)
    logits = torch.randn(16, 2048, MPT_VOCAB, device="cuda", generator=gen).bfloat16()
    labels = torch.randint(0, MPT_VOCAB, (16, 2048), device="cuda", generator=gen)
    got_in, want_in = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    activities = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        got = next_token_loss_sum(got_in, labels)
        got.backward()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(kernels) < 500, len(kernels)
    want = reference(want_in, labels)
    want.backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    torch.testing.assert_close(got_in.grad.float(), want_in.grad.float(), atol=1e-6, rtol=0.02)

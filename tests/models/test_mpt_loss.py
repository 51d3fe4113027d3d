"""The chunked next-token cross-entropy equals F.cross_entropy, value and gradient."""

import pytest
import torch
import torch.nn.functional as F

from llmfoundry.models.layers import loss as loss_module
from llmfoundry.models.layers.loss import next_token_loss_sum


def reference(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    flat = logits[:, :-1].flatten(0, 1).float()
    return F.cross_entropy(flat, labels[:, 1:].flatten(), ignore_index=-100, reduction="sum")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_elements", [64, 1 << 20])  # many chunks (ragged last) / one
def test_value_and_gradient_match_cross_entropy(monkeypatch, dtype, chunk_elements):
    monkeypatch.setattr(loss_module, "_CHUNK_ELEMENTS", chunk_elements)
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

"""The attention kernels by name (a family config's `attn_impl`), and the check that names them.

Every entry has the signature of `attention.AttnFn`; see `attention.py` for the contract.
`torch` is the reference the others are tested against; `sdpa` is PyTorch's fused kernel (any
device); `flex` is FlexAttention (compiled; GPU for training); `flash` is flash-attn 2 (CUDA,
`pip install 'llmfoundry[gpu]'`). `kernel_name` says which kernel a call runs (for sdpa, the
backend `attention.sdpa_plan` chose, which CUDA is held to); `record_kernels` collects the names
over a model's forward. `PREPARE` builds what each kernel takes from a forward's mask before
the blocks run (`attention.AttentionMasks.forward`).

Agreement with `torch` in fp32, as tested (tests/models/test_mpt_attention.py,
test_mpt_kernels.py): sdpa within 1e-5 absolute, forward and gradients; flex within 1e-5
forward on CPU (its backward needs a GPU); flash's glue (with the kernel's documented semantics
written out) within 1e-5, forward and gradients. On a GPU the tests require flex and flash in
bf16 within 2e-2 relative error of `torch`, forward and gradients (skipped without CUDA).
A context-parallel rank's queries (at given positions among the keys): torch, sdpa and flash's
glue give one process's logits within 1e-5, flex its forward against `torch`'s
(tests/distributed/test_context.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from llmfoundry.models.layers import flash, flex
from llmfoundry.models.layers.attention import (
    AttentionMask,
    AttnFn,
    Prepare,
    plan_for,
    prepare_dense,
    sdpa_attention,
    torch_attention,
)
from llmfoundry.utils.errors import UserError

ATTN_IMPLS: dict[str, AttnFn] = {
    "torch": torch_attention,
    "sdpa": sdpa_attention,
    "flex": flex.flex_attention,
    "flash": flash.flash_attention,
}

# What each kernel builds of a forward's mask before the blocks run (`AttentionMasks.forward`).
PREPARE: dict[str, Prepare] = {
    "torch": prepare_dense,
    "sdpa": prepare_dense,
    "flex": flex.prepare,
    "flash": flash.prepare,
}

# The kernels that take the mask as a dense additive bias (`AttentionMask.dense_bias`): with
# ALiBi or a sliding window they keep the causal bias of the longest input cached
# (`AttentionMasks.causal_bias`), which the memory planner counts. flex and flash never build it.
DENSE_BIAS_IMPLS = frozenset({"torch", "sdpa"})


def check_attn_impl(name: str, owner: str, attn_pdrop: float = 0.0) -> None:
    """Raise a ValueError that says what to do if `name` is not a usable attention kernel;
    the message names the field as `owner` (the config class, any family's) spells it."""
    if name not in ATTN_IMPLS:
        allowed = ", ".join(repr(n) for n in ATTN_IMPLS)
        raise UserError(f"{owner}.attn_impl={name!r} is not known; allowed: {allowed}")
    if name == "flash" and (problem := flash.missing_package()):
        raise UserError(f"{owner}.{problem}")
    if name == "flex" and attn_pdrop > 0:
        raise UserError(
            f"{owner}.attn_impl='flex' has no attention dropout; set attn_pdrop=0 or use sdpa"
        )


def kernel_name(
    attn_impl: str, q: torch.Tensor, k: torch.Tensor, mask: AttentionMask, dropout_p: float = 0.0
) -> str:
    """The kernel `ATTN_IMPLS[attn_impl]` runs for q, k and `mask`: "sdpa:flash",
    "sdpa:efficient" or "sdpa:math" (on CUDA the only backend allowed; on CPU torch's CPU
    kernels of those names), "flex", "flash-attn" or "flash-attn:varlen" (documents), "torch"."""
    if attn_impl == "sdpa":
        return f"sdpa:{plan_for(q, k, mask, dropout_p).kernel}"
    if attn_impl == "flash" and mask.sequence_id is not None:
        return "flash-attn:varlen"
    return {"flash": "flash-attn"}.get(attn_impl, attn_impl)


@contextlib.contextmanager
def record_kernels(model: nn.Module) -> Iterator[list[str]]:
    """Within it, every attention call of `model` (any family: its modules with an `attn_fn`)
    appends the `kernel_name` of what it runs to the list it yields. Eager forwards only:
    compiled blocks record what they traced."""
    names = {fn: name for name, fn in ATTN_IMPLS.items()}
    ran: list[str] = []
    modules = [m for m in model.modules() if getattr(m, "attn_fn", None) in names]

    def recording(fn: AttnFn) -> AttnFn:
        def call(q, k, v, mask, dropout_p, scale):  # noqa: ANN001, ANN202 (AttnFn's)
            ran.append(kernel_name(names[fn], q, k, mask, dropout_p))
            return fn(q, k, v, mask, dropout_p, scale)

        return call

    originals = [m.attn_fn for m in modules]
    for module, fn in zip(modules, originals, strict=True):
        module.attn_fn = recording(fn)
    try:
        yield ran
    finally:
        for module, fn in zip(modules, originals, strict=True):
            module.attn_fn = fn

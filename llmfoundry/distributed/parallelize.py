"""Applying parallelism to a model from outside: activation checkpointing (more to follow)."""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from llmfoundry.utils.errors import UserError

# What selective activation checkpointing keeps: matrix multiplies' outputs (linear layers
# dispatch to these); everything else in a block is recomputed in backward.
_SAVED_BY_SELECTIVE = (
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.baddbmm.default,
)


def checkpoint_blocks(blocks: list[torch.nn.Module], every: int, selective: bool) -> None:
    """Recompute the activations of every `every`-th block in backward (0: none) instead of
    keeping them. `selective` keeps the outputs of the matrix multiplies (the ops that cost
    the flops) and recomputes the rest (norms, activations, attention softmax inputs), which
    cuts most of a block's activation memory for a few percent more compute."""
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

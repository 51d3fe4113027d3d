"""Your own ``nn.Module`` as a model (conf/model/custom.yaml, README "Your own model").

The trainer's contract is `llmfoundry.core.model`: ``forward(batch)`` and ``loss(outputs,
batch)``. What else a user module may carry, each optional:

- ``fsdp_blocks``: a tuple of block classes (config: ``model.fsdp_blocks=[my_pkg.Block]``);
  every submodule of one is a `ParallelPlan` block, which FSDP shards as one unit and
  activation checkpointing recomputes. Without it a sharding strategy refuses the model.
- ``vocab_size``: checked against the data's token ids before training.
- ``max_seq_len``: the training length when the config's ``max_seq_len`` is null.

Generation (the ``generate`` callback) calls ``forward({"input_ids": ids})`` on the whole
sequence at every step (no KV cache); a forward that returns no logits [batch, seq, vocab]
skips the samples with one line.
"""

from __future__ import annotations

from torch import nn

from llmfoundry.models.plan import ParallelPlan
from llmfoundry.utils.errors import UserError

# The key of conf/model/custom.yaml that is not the builder's: the classes FSDP wraps.
FSDP_BLOCKS_KEY = "fsdp_blocks"


def set_fsdp_blocks(model: nn.Module, classes: tuple[type, ...]) -> None:
    """Record the block classes on `model` (its ``fsdp_blocks``), refusing any it lacks: a
    misnamed class would leave FSDP one unit for the whole model, silently."""
    for cls in classes:
        if not isinstance(cls, type) or not issubclass(cls, nn.Module):
            raise UserError(f"model.{FSDP_BLOCKS_KEY}: {cls!r} is not an nn.Module class")
        if not any(isinstance(m, cls) for m in model.modules()):
            raise UserError(
                f"model.{FSDP_BLOCKS_KEY}: {type(model).__name__} holds no {cls.__name__}; "
                "name the class of its repeated blocks (e.g. [my_pkg.Block])"
            )
    if classes:  # else the module's own fsdp_blocks, if it has one
        model.fsdp_blocks = classes


def user_plan(model: nn.Module) -> ParallelPlan | None:
    """The plan of a user module that names its ``fsdp_blocks``; None when it names none."""
    classes = getattr(model, FSDP_BLOCKS_KEY, None)
    if not classes:
        return None
    blocks = [m for m in model.modules() if isinstance(m, tuple(classes))]
    return ParallelPlan(
        blocks=blocks,
        tensor_parallel_refusal=f"{type(model).__name__} (your own module) has no "
        "tensor-parallel plan; train it with parallelism.tp=1",
    )

"""Weights holding NaN or infinity are never saved: a diverged model saved under a new name
would become `latest` and push the good checkpoints out by pruning.

Every save checks the weights before anything is written (`refuse_non_finite`), so the previous
checkpoints, `latest` and the pruning stay as they were. With several processes the ranks
decide together: each flags the weights whose part it holds (its shard under FSDP or ZeRO-3, a
whole replica under DDP) and one all-reduce sums the flags, so every rank raises the same error
at the same point and none is left waiting in the save's collectives for a rank that refused.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from llmfoundry.checkpoint.manifest import CheckpointError

# What to do about a save the trainer refused (its run diverged).
RESUME_FIX = (
    "the earlier checkpoints are kept: resume from the last one with a lower optimizer.lr, and "
    "keep the nan_detector callback on"
)


def refuse_non_finite(
    what: str,
    weights: Mapping[str, torch.Tensor],
    all_reduce_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
    device: torch.device | str = "cpu",
    cause: str = "training diverged",
    fix: str = RESUME_FIX,
) -> None:
    """Raise a one-line `CheckpointError` about saving `what` if any of `weights` holds NaN or
    infinity, naming the first such weight, the likely `cause` and the `fix`.

    `weights`: this rank's part of each weight, where it lives (every rank passes the same names
    in the same order). `all_reduce_sum` (a collective such as `Strategy.all_reduce_sum`, whose
    backend reduces tensors on `device`) makes the decision every rank's: a weight counts when
    any rank's part of it is not finite. The flags stay on the device until one read at the end;
    each tensor is judged by its largest and smallest value (NaN propagates through both, an
    infinity shows in one), so no temporary as large as a weight is allocated at save time.
    """
    names = list(weights)
    flags = torch.zeros(len(names), dtype=torch.int32, device=device)
    for index, tensor in enumerate(weights.values()):
        if tensor.is_floating_point() and tensor.numel():
            extremes = torch.stack((tensor.amax(), tensor.amin()))
            flags[index] = (~torch.isfinite(extremes).all()).to(device)
    if all_reduce_sum is not None:
        flags = all_reduce_sum(flags)
    bad = [name for name, flag in zip(names, flags.tolist(), strict=True) if flag]
    if not bad:
        return
    more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
    raise CheckpointError(
        f"refusing to save {what}: weight {bad[0]!r}{more} holds NaN or infinity ({cause}); {fix}"
    )

"""What a checkpoint format's reader returns (formats.py), whatever the format: a run to continue
(`Checkpoint`) or a model to use (`SavedModel`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Checkpoint:
    """What one rank reads back: the weights (None in a sharded checkpoint, whose weights
    sharded.py loads), the run state, and its own RNG states if saved."""

    path: str
    model: dict[str, torch.Tensor] | None
    state: dict[str, Any]
    rng: dict[str, Any] | None
    # The program that wrote it when not llmfoundry (its run state translated into ours), and
    # what of that run does not continue here (said when a run continues from it).
    origin: str | None = None
    not_carried: str | None = None


@dataclass(frozen=True)
class SavedModel:
    """A checkpoint's model: whole weights by our names, our config object, where its tokenizer
    is (None: unknown), the name of its run and the config that run recorded (may be empty)."""

    weights: dict[str, torch.Tensor]
    config: Any
    tokenizer: str | None
    run_name: str | None
    recorded: Mapping[str, Any] = field(default_factory=dict)

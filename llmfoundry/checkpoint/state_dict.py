"""The contents of a checkpoint: everything needed to continue a run exactly."""

from __future__ import annotations

from typing import Any

from llmfoundry.trainer.state import State


def training_state(state: State) -> dict[str, Any]:
    return {
        "model": state.model.state_dict(),
        "optimizer": state.optimizer.state_dict(),
        "timestamp": state.timestamp.state_dict(),
        "algorithms": [a.state_dict() for a in state.algorithms],
        "callbacks": [c.state_dict() for c in state.callbacks],
    }


def load_training_state(state: State, checkpoint: dict[str, Any]) -> None:
    state.model.load_state_dict(checkpoint["model"])
    state.optimizer.load_state_dict(checkpoint["optimizer"])
    state.timestamp.load_state_dict(checkpoint["timestamp"])
    for obj, saved in zip(state.algorithms, checkpoint["algorithms"], strict=False):
        obj.load_state_dict(saved)
    for obj, saved in zip(state.callbacks, checkpoint["callbacks"], strict=False):
        obj.load_state_dict(saved)

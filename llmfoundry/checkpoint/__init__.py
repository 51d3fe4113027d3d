"""Checkpoints: what a training state saves, and how it is written and read back."""

from llmfoundry.checkpoint.io import load_checkpoint, save_checkpoint
from llmfoundry.checkpoint.state_dict import load_training_state, training_state

__all__ = ["load_checkpoint", "load_training_state", "save_checkpoint", "training_state"]

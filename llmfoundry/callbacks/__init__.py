"""Callbacks: observe training events and act around them."""

from llmfoundry.callbacks.checkpoint_saver import CheckpointSaver
from llmfoundry.callbacks.generate import Generate
from llmfoundry.callbacks.lr_monitor import LRMonitor
from llmfoundry.callbacks.speed_monitor import SpeedMonitor

__all__ = ["CheckpointSaver", "Generate", "LRMonitor", "SpeedMonitor"]

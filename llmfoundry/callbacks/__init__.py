"""Callbacks: observe training events and act around them."""

from llmfoundry.callbacks.checkpoint_saver import CheckpointSaver
from llmfoundry.callbacks.early_stopper import EarlyStopper
from llmfoundry.callbacks.generate import Generate
from llmfoundry.callbacks.hf_checkpointer import HFCheckpointer
from llmfoundry.callbacks.icl_eval import ICLEval
from llmfoundry.callbacks.lr_monitor import LRMonitor
from llmfoundry.callbacks.memory_monitor import MemoryMonitor
from llmfoundry.callbacks.nan_detector import NaNDetector
from llmfoundry.callbacks.run_status import RunStatus
from llmfoundry.callbacks.runtime_estimator import RuntimeEstimator
from llmfoundry.callbacks.speed_monitor import SpeedMonitor
from llmfoundry.callbacks.token_id_check import TokenIdCheck

__all__ = [
    "CheckpointSaver",
    "EarlyStopper",
    "Generate",
    "HFCheckpointer",
    "ICLEval",
    "LRMonitor",
    "MemoryMonitor",
    "NaNDetector",
    "RunStatus",
    "RuntimeEstimator",
    "SpeedMonitor",
    "TokenIdCheck",
]

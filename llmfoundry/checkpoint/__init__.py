"""Checkpoints: what a run saves (state_dict.py), how it is stored (io.py), preemption signals.

Settings (top-level keys of conf/train.yaml): save_folder, save_interval,
num_checkpoints_to_keep, load_path, load_ignore_keys, autoresume.
"""

from llmfoundry.checkpoint.io import latest_checkpoint, prune, read_checkpoint, read_latest
from llmfoundry.checkpoint.preemption import Preemption
from llmfoundry.checkpoint.state_dict import (
    LOADABLE_KEYS,
    WEIGHTS_ONLY,
    check_ignore_keys,
    load_checkpoint,
    save_checkpoint,
)

__all__ = [
    "LOADABLE_KEYS",
    "WEIGHTS_ONLY",
    "Preemption",
    "check_ignore_keys",
    "latest_checkpoint",
    "load_checkpoint",
    "prune",
    "read_checkpoint",
    "read_latest",
    "save_checkpoint",
]

"""Checkpoints: what a run saves (state_dict.py), how it is stored (io.py) and checked
(manifest.py), what may change on resume (compat.py), one run per folder (lock.py), preemption
signals.

Settings (top-level keys of conf/train.yaml): save_folder, save_interval,
num_checkpoints_to_keep, load_path, load_ignore_keys, autoresume, save_overwrite.

Names are imported on first use (`llmfoundry.utils.lazy`): the config check reads keys.py
without torch.
"""

from typing import TYPE_CHECKING

from llmfoundry.utils.lazy import lazy_exports

if TYPE_CHECKING:
    from llmfoundry.checkpoint.io import (
        PendingCheckpoint,
        checkpoint_names,
        clean,
        delete_checkpoints,
        find_checkpoint,
        latest_checkpoint,
        newest_complete,
        newest_damage,
        probe_writable,
        prune,
        read_checkpoint,
        read_latest,
        resolve,
    )
    from llmfoundry.checkpoint.keys import LOADABLE_KEYS, WEIGHTS_ONLY, check_ignore_keys
    from llmfoundry.checkpoint.manifest import CheckpointError
    from llmfoundry.checkpoint.preemption import Preemption
    from llmfoundry.checkpoint.state_dict import begin_save, load_checkpoint, save_checkpoint

__all__ = [
    "CheckpointError",
    "LOADABLE_KEYS",
    "WEIGHTS_ONLY",
    "PendingCheckpoint",
    "Preemption",
    "begin_save",
    "check_ignore_keys",
    "checkpoint_names",
    "clean",
    "delete_checkpoints",
    "find_checkpoint",
    "newest_complete",
    "newest_damage",
    "probe_writable",
    "latest_checkpoint",
    "load_checkpoint",
    "prune",
    "read_checkpoint",
    "read_latest",
    "resolve",
    "save_checkpoint",
]
__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        **dict.fromkeys(
            (
                "PendingCheckpoint",
                "checkpoint_names",
                "clean",
                "delete_checkpoints",
                "find_checkpoint",
                "latest_checkpoint",
                "newest_complete",
                "newest_damage",
                "probe_writable",
                "prune",
                "read_checkpoint",
                "read_latest",
                "resolve",
            ),
            ".io",
        ),
        **dict.fromkeys(("LOADABLE_KEYS", "WEIGHTS_ONLY", "check_ignore_keys"), ".keys"),
        "CheckpointError": ".manifest",
        "Preemption": ".preemption",
        **dict.fromkeys(("begin_save", "load_checkpoint", "save_checkpoint"), ".state_dict"),
    },
)

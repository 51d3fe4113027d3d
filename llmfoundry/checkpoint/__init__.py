"""Checkpoints: what a run saves (state_dict.py), how it is written (writer.py), read back
(reader.py), found in a save folder (catalogue.py), named by a load path (probe.py; formats.py:
one reader interface for ours and Composer's, composer.py) and checked (manifest.py), what may
change on resume (compat.py), one run per folder (lock.py), preemption signals.
Model and optimizer state is read and written here too, whatever the strategy: whole tensors
(state.py), each rank's shards through torch.distributed.checkpoint (sharded.py,
dcp_reader.py), DeepSpeed's engine's own files (deepspeed.py); strategies know nothing of
checkpoints beyond their `sharded_checkpoints`/`async_save` flags. A trained model split over
torchrun's processes for evaluation, each reading only its part of the shards: on_mesh.py.

Settings (top-level keys of conf/train.yaml): save_folder, save_interval,
num_checkpoints_to_keep, load_path, load_ignore_keys, autoresume, save_overwrite.

Names are imported on first use (`llmfoundry.utils.lazy`): the config check reads keys.py
without torch.
"""

from llmfoundry.utils.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        ".catalogue": (
            "checkpoint_names",
            "clean",
            "delete_checkpoints",
            "find_checkpoint",
            "latest_checkpoint",
            "newest_complete",
            "newest_damage",
            "prune",
            "read_latest",
        ),
        ".reader": ("read_checkpoint",),
        ".formats": ("locate",),
        ".probe": ("resolve",),
        ".writer": ("PendingCheckpoint", "probe_writable"),
        ".keys": ("LOADABLE_KEYS", "WEIGHTS_ONLY", "check_ignore_keys"),
        ".manifest": ("CheckpointError",),
        ".preemption": ("Preemption",),
        ".state_dict": ("begin_save", "load_checkpoint", "save_checkpoint"),
    },
)

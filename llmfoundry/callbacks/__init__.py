"""Callbacks: observe training events and act around them.

Names are imported on first use (`llmfoundry.utils.lazy`): a run imports the callbacks its
config names, not all of them (`HFCheckpointer` alone brings in transformers, a second or more
of every script's start that most runs never use).
"""

from llmfoundry.utils.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        ".checkpoint_saver": ("CheckpointSaver",),
        ".early_stopper": ("EarlyStopper",),
        ".generate": ("Generate",),
        ".hf_checkpointer": ("HFCheckpointer",),
        ".icl_eval": ("ICLEval",),
        ".lr_monitor": ("LRMonitor",),
        ".memory_monitor": ("MemoryMonitor",),
        ".nan_detector": ("NaNDetector",),
        ".run_status": ("RunStatus",),
        ".runtime_estimator": ("RuntimeEstimator",),
        ".speed_monitor": ("SpeedMonitor",),
        ".token_id_check": ("TokenIdCheck",),
    },
)

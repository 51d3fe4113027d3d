"""Data: the MDS format (mds), streaming datasets (streaming), data_prep library code (prep),
and what the trainer uses: :class:`DataConfig` and :func:`build_dataloader` (text.py)."""

from llmfoundry.data.text import (
    DataConfig,
    StreamingTextDataset,
    build_dataloader,
    build_eval_dataloaders,
)

__all__ = ["DataConfig", "StreamingTextDataset", "build_dataloader", "build_eval_dataloaders"]

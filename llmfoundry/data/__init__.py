"""Data: the MDS format (mds), streaming datasets (streaming), data_prep library code (prep),
the trainer's datasets (text.py: MDS token rows; memmap.py: a token file) and the one builder
that turns the ``data`` config group into loaders (builder.py)."""

from llmfoundry.data.builder import DataLoaders, DataSplits, build_loaders
from llmfoundry.data.memmap import MemmapTokens
from llmfoundry.data.text import StreamingTextDataset

__all__ = ["DataLoaders", "DataSplits", "MemmapTokens", "StreamingTextDataset", "build_loaders"]

"""Data: the MDS format (mds), streaming datasets (streaming), data_prep library code (prep),
the trainer's datasets (text.py: MDS token rows; memmap.py: a token file) and the one builder
that turns the ``data`` config group into loaders (builder.py).

Names are imported on first use (`llmfoundry.utils.lazy`): data_prep's scripts read and write
token files and MDS shards without torch, which the loaders here need (a second or more of
every data_prep command's start).
"""

from llmfoundry.utils.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        ".builder": ("DataLoaders", "DataSplits", "build_loaders"),
        ".memmap": ("MemmapTokens",),
        ".text": ("StreamingTextDataset",),
    },
)

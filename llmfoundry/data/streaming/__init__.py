"""Streaming MDS datasets: object-store caching, deterministic elastic sampling, DataLoader.

Modules: world (rank/node/worker), sampling (the epoch's order and its partition), download
(fsspec fetches), locking (flock), cache (one stream's local shards), eviction (cache_limit),
readers (open shards of this process), predownload (background fetches), stream (a source and
its share), epochs (what every trainer dataset shares: epochs, resumption, the rank partition),
dataset (StreamingDataset), loader (StreamingDataLoader and the trainer contract).
"""

from llmfoundry.data.streaming.cache import ShardCache
from llmfoundry.data.streaming.dataset import StreamingDataset
from llmfoundry.data.streaming.epochs import EpochDataset
from llmfoundry.data.streaming.loader import StreamingDataLoader
from llmfoundry.data.streaming.sampling import EpochOrder, RankPlan, SpanLayout, stream_counts
from llmfoundry.data.streaming.stream import Stream
from llmfoundry.data.streaming.world import World

__all__ = [
    "EpochDataset",
    "EpochOrder",
    "RankPlan",
    "SpanLayout",
    "ShardCache",
    "Stream",
    "StreamingDataLoader",
    "StreamingDataset",
    "World",
    "stream_counts",
]

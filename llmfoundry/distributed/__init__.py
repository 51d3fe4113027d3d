"""Distributed strategies: applied to a model from outside; model code knows nothing of them.

Each lays the processes out on one device mesh (mesh.py: data-parallel replicas and shards,
context, tensor and pipeline axes), the config's `parallelism:` block (`parallel_dims`), and
applies parallelism with the functions of parallelize.py.
"""

from llmfoundry.distributed.base import (
    OutOfMemoryElsewhere,
    Strategy,
    materialize,
    resolve_device,
    unwrap_model,
)
from llmfoundry.distributed.ddp import DDP
from llmfoundry.distributed.deepspeed import DeepSpeed
from llmfoundry.distributed.fsdp import FSDP
from llmfoundry.distributed.mesh import ParallelDims
from llmfoundry.distributed.single import SingleDevice

__all__ = [
    "DDP",
    "DeepSpeed",
    "FSDP",
    "OutOfMemoryElsewhere",
    "ParallelDims",
    "SingleDevice",
    "Strategy",
    "materialize",
    "resolve_device",
    "unwrap_model",
]

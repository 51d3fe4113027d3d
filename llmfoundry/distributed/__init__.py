"""Distributed strategies: applied to a model from outside; model code knows nothing of them."""

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
from llmfoundry.distributed.single import SingleDevice

__all__ = [
    "DDP",
    "DeepSpeed",
    "FSDP",
    "OutOfMemoryElsewhere",
    "SingleDevice",
    "Strategy",
    "materialize",
    "resolve_device",
    "unwrap_model",
]

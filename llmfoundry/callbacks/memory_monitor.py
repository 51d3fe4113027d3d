"""Memory use after every batch, to size microbatches and to catch leaks before they OOM.

On CUDA, the caching allocator's statistics (GiB):
``memory/allocated_gib`` and ``memory/peak_allocated_gib`` (tensors), ``memory/reserved_gib`` and
``memory/peak_reserved_gib`` (what the allocator holds from the driver), and
``memory/alloc_retries``: how often the allocator had to free its cache and retry, the sign of a
run at the edge of OOM that is slowed by fragmentation.

On CPU, the process's resident set (GiB): ``memory/rss_gib`` (now, where /proc is available)
and ``memory/peak_rss_gib`` (the high-water mark reported by the OS).
"""

from __future__ import annotations

import os
import resource
import sys

import torch

from llmfoundry.core.engine import Callback, Logger
from llmfoundry.core.state import State

_GIB = 1024**3


def cuda_memory(device: torch.device) -> dict[str, float]:
    stats = torch.cuda.memory_stats(device)
    return {
        "memory/allocated_gib": stats.get("allocated_bytes.all.current", 0) / _GIB,
        "memory/peak_allocated_gib": stats.get("allocated_bytes.all.peak", 0) / _GIB,
        "memory/reserved_gib": stats.get("reserved_bytes.all.current", 0) / _GIB,
        "memory/peak_reserved_gib": stats.get("reserved_bytes.all.peak", 0) / _GIB,
        "memory/alloc_retries": float(stats.get("num_alloc_retries", 0)),
    }


def process_memory() -> dict[str, float]:
    # ru_maxrss is in KiB on Linux, in bytes on macOS.
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    metrics = {"memory/peak_rss_gib": peak * (1 if sys.platform == "darwin" else 1024) / _GIB}
    try:
        with open("/proc/self/statm") as f:
            resident_pages = int(f.read().split()[1])
        metrics["memory/rss_gib"] = resident_pages * os.sysconf("SC_PAGE_SIZE") / _GIB
    except FileNotFoundError:  # no procfs (macOS): the peak is what the OS tells us
        pass
    return metrics


class MemoryMonitor(Callback):
    def batch_end(self, state: State, logger: Logger) -> None:
        if state.device.type == "cuda":
            logger.log_metrics(cuda_memory(state.device))
        else:
            logger.log_metrics(process_memory())

"""Let a CPU training process reuse the memory it frees instead of mapping it anew each step.

glibc's malloc serves large blocks (above a threshold that grows to at most 32 MB) with their own
`mmap` and unmaps each one when it is freed. A training step on the CPU allocates and frees the
same large tensors every step (the logits, activations, their gradients), so the kernel maps and
zero-fills them again every step: at mpt-tiny's shape (16 x 256 tokens, 8192-token vocabulary)
that page-faulting was about 0.3 s of system time in a 3.3 s step. Serving every block from the
heap (`M_MMAP_MAX` = 0) and never trimming it (`M_TRIM_THRESHOLD`) keeps freed blocks for the
next step. Resident memory then stays near the step's peak, which every step reaches anyway.

On an accelerator the large tensors live in its memory (and its caching allocator), so this is
for CPU training only. Other C libraries (musl, macOS) have no `mallopt`: nothing changes there.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

# glibc's <malloc.h> parameter numbers.
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_NEVER_TRIM = 2**31 - 1  # bytes; mallopt takes an int


def reuse_freed_host_memory() -> bool:
    """Make this process's malloc keep freed blocks for reuse; False where it cannot (no glibc).

    Process-wide and lasting: call it once, when the process is going to train on the CPU.
    Processes forked afterwards (data loader workers) inherit it.
    """
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError, TypeError):
        log.debug("no mallopt in the C library (%s): freed host memory is returned as usual", name)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # mallopt returns 1 on success, 0 on error.
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, _NEVER_TRIM))

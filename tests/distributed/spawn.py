"""Run a function in `world` gloo processes, bounded by a deadline (a hang fails the test)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import pytest
import torch
import torch.multiprocessing as mp

from tests.conftest import free_port  # noqa: F401 (the ranks' port, for the tests here)


def join_env(rank: int, world: int, port: int) -> None:
    """What `torch.distributed` reads to join the group (called first in each child)."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)


def run_ranks(
    fn: Callable, world: int, *args, limit_s: float = 180, killed: bool = False
) -> list[int | None]:
    """`fn(rank, world, *args)` in `world` spawned processes (they write their results); `args`
    usually start with a `free_port()`. Returns the processes' exit codes.

    ``killed``: the ranks are expected to end by a signal (a test of a kill), so an exit by a
    signal returns instead of failing, and the ranks get 10 s to die together before the
    survivors are terminated.
    """
    context = mp.start_processes(
        fn, args=(world, *args), nprocs=world, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + limit_s
    try:
        while not context.join(timeout=1, grace_period=10 if killed else None):
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.kill()
                pytest.fail(f"{world}-process run did not finish within {limit_s} s")
    except mp.ProcessExitedException:
        if not killed:
            raise
    return [process.exitcode for process in context.processes]

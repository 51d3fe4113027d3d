"""Host synchronisations per training step, and what they cost when each one is slow.

On an accelerator, reading a device value on the host (``.item()``, ``.tolist()``, ``float(t)``,
``if t:``) waits for every kernel queued before it: the host stops queueing work and the device
idles while it catches up. CPU has no such stall (and ``torch.cuda.set_sync_debug_mode`` is
CUDA-only), so this counts the reads by instrumenting them, and models their cost as a fixed
``--sync-ms`` per read (the device draining its queue) on top of the step's own time.

The trainer trains a tiny MPT on in-memory batches with the callbacks and loggers a run
usually has: console (every 10 batches), progress bar, JSONL, NaN detector, speed monitor,
lr monitor, run status; evaluation off. Reported, over the steps after ``--warmup``: host reads
per step (outside torch itself), the strategy's all-reduces per step (what a multi-process run
would issue; a single process runs them as no-ops), the step's CPU time (this process's CPU
seconds, which other jobs on a shared machine distort much less than wall time; best of
``--repeats``), and steps/s with the modelled cost of the reads added.

    PYTHONPATH=. OMP_NUM_THREADS=1 python bench/host_sync.py
    PYTHONPATH=. OMP_NUM_THREADS=1 python bench/host_sync.py --ranks 2   # DDP, gloo; rank 0
    PYTHONPATH=. OMP_NUM_THREADS=1 python bench/host_sync.py --ranks 2 --strategy fsdp \
        --microbatch auto   # auto-microbatching under FSDP, counted once the size has settled
    PYTHONPATH=/path/to/other/checkout python bench/host_sync.py   # the same on other code
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import socket
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from llmfoundry.callbacks import LRMonitor, NaNDetector, RunStatus, SpeedMonitor
from llmfoundry.distributed import DDP, FSDP, SingleDevice, Strategy
from llmfoundry.loggers import ConsoleLogger, JSONLLogger, ProgressBarLogger
from llmfoundry.models.mpt import MPTConfig, MPTForCausalLM
from llmfoundry.trainer import Callback, Trainer

_TORCH_DIR = os.path.dirname(torch.__file__)
_READS = ("item", "tolist", "__float__", "__int__", "__bool__")


class Counter:
    def __init__(self) -> None:
        self.reads = 0
        self.all_reduces = 0
        self.active = False


def _from_torch(frame) -> bool:
    """Reads inside torch itself are left out: its optimizers read their step counters, which
    stay on the host even on an accelerator (``state["step"]`` is a CPU tensor)."""
    return frame.f_code.co_filename.startswith(_TORCH_DIR)


@contextmanager
def instrumented(counter: Counter) -> Iterator[None]:
    """Count every host read of a tensor while `counter` is active."""
    originals = {name: getattr(torch.Tensor, name) for name in _READS}

    def wrap(original):
        @functools.wraps(original)
        def read(self, *args, **kwargs):
            if counter.active and not _from_torch(sys._getframe(1)):
                counter.reads += 1
            return original(self, *args, **kwargs)

        return read

    for name, original in originals.items():
        setattr(torch.Tensor, name, wrap(original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


class Window(Callback):
    """Counts from the batch after `warmup` on, and times those batches."""

    def __init__(self, counter: Counter, warmup: int) -> None:
        self.counter, self.warmup = counter, warmup
        self.started = 0.0

    def batch_end(self, state, logger) -> None:
        if state.timestamp.batch == self.warmup:
            self.counter.active = True
            self.started = time.process_time()


def counting(strategy: type[Strategy], counter: Counter, **kwargs) -> Strategy:
    """`strategy` whose own all-reduces (not DDP's gradient buckets) are counted."""

    class Counting(strategy):
        def all_reduce_sum(self, tensor: torch.Tensor, group: Any = None) -> torch.Tensor:
            if counter.active:
                counter.all_reduces += 1
            return super().all_reduce_sum(tensor, group)

    return Counting(device="cpu", **kwargs)


def run(
    steps: int,
    warmup: int,
    ranks: int = 1,
    status_interval_s: float = 10.0,
    strategy: str = "ddp",
    microbatch: int | str | None = None,
) -> dict[str, float]:
    """Counts over the steps after `warmup`. `status_interval_s`: the run-status heartbeat, the
    one reader on a clock rather than a batch count (a slow machine gets more of its reads).
    `strategy` (ddp or fsdp) is the one of several `ranks`; `microbatch` the trainer's
    device_train_microbatch_size ("auto": searched, with guards until it settles)."""
    counter = Counter()
    if ranks == 1:
        counted = counting(SingleDevice, counter)
    else:
        counted = counting({"ddp": DDP, "fsdp": FSDP}[strategy], counter, timeout_s=300)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (steps, 8 // ranks, 64), generator=generator)
    batches = [{"input_ids": x, "labels": x.clone()} for x in ids]
    config = MPTConfig(
        d_model=64, n_heads=2, n_layers=2, max_seq_len=64, vocab_size=256, init_device="meta"
    )
    window = Window(counter, warmup)
    with tempfile.TemporaryDirectory() as run_dir, instrumented(counter):
        trainer = Trainer(
            model=MPTForCausalLM(config),
            strategy=counted,
            train_dataloader=batches,
            max_duration=f"{steps}ba",
            optimizer=functools.partial(torch.optim.AdamW, lr=1e-3),
            run_dir=run_dir,
            callbacks=[
                window,
                NaNDetector(),
                LRMonitor(),
                SpeedMonitor(peak_flops=1e12),
                RunStatus(interval_s=status_interval_s),
            ],
            loggers=[ConsoleLogger("10ba"), ProgressBarLogger(), JSONLLogger()],
            device_train_microbatch_size=microbatch,
        )
        trainer.fit()
        elapsed = time.process_time() - window.started
    timed = steps - warmup
    return {
        "reads_per_step": counter.reads / timed,
        "all_reduces_per_step": counter.all_reduces / timed,
        "cpu_ms_per_step": 1000 * elapsed / timed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--sync-ms", type=float, default=2.0, help="modelled cost of one read")
    parser.add_argument("--repeats", type=int, default=3, help="best of this many runs")
    parser.add_argument("--ranks", type=int, default=1, help="processes (gloo), batch split")
    parser.add_argument("--strategy", choices=("ddp", "fsdp"), default="ddp", help="of --ranks")
    parser.add_argument("--microbatch", help="device_train_microbatch_size: an int or auto")
    args = parser.parse_args()
    torch.set_num_threads(1)
    options: dict[str, Any] = {"microbatch": _microbatch(args.microbatch)}
    if args.ranks > 1:
        options["strategy"] = args.strategy
        results = [ranked(args.ranks, args.steps, args.warmup, **options)
                   for _ in range(args.repeats)]  # fmt: skip
    else:
        results = [run(args.steps, args.warmup, **options) for _ in range(args.repeats)]
    best = min(results, key=lambda r: r["cpu_ms_per_step"])
    step_ms, reads = best["cpu_ms_per_step"], best["reads_per_step"]
    print(
        f"{reads:.2f} host reads/step, {best['all_reduces_per_step']:.2f} all-reduces/step, "
        f"{step_ms:.2f} CPU ms/step (best of {args.repeats}): {1000 / step_ms:.1f} steps/s; "
        f"with {args.sync_ms:g} ms per read: {1000 / (step_ms + reads * args.sync_ms):.1f} steps/s"
    )


def _microbatch(text: str | None) -> int | str | None:
    return text if text in (None, "auto") else int(text)


def _rank(rank: int, ranks: int, run_args: tuple, options: dict, port: int, out: str) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(ranks),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    result = run(*run_args, ranks, **options)
    if rank == 0:
        Path(out).write_text(json.dumps(result))


def ranked(ranks: int, steps: int, warmup: int, **options: Any) -> dict[str, float]:
    """`run` in `ranks` processes (`options`: its keywords); rank 0's counts and time."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as folder:
        out = str(Path(folder) / "rank0.json")
        args = (ranks, (steps, warmup), options, port, out)
        mp.start_processes(_rank, args=args, nprocs=ranks, start_method="spawn")
        return json.loads(Path(out).read_text())


if __name__ == "__main__":
    main()

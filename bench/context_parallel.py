"""Context parallelism (`parallelism.cp=C`): activation memory per rank and step time against
sequence length at cp = 1, 2, 4, with the ratios against cp=1 measured in the same run.

Each cp runs as its own job of C spawned processes (gloo on CPU, nccl on GPUs; one
data-parallel rank: the C ranks share every sequence), training a model of conf/model (default
mpt-tiny: ALiBi, sdpa, float32) under `FSDP(parallelism={"cp": C})` with a bare loop (forward on
this rank's part of each sequence, the loss on its targets, backward, AdamW) on random tokens,
one batch of --batch sequences per step, the lengths ascending; then the table:

    python bench/context_parallel.py                         # CPU, gloo: cp 1, 2, 4 at 512-4096
    python bench/context_parallel.py --cps 1 2 --lengths 256 512 --steps 1     # a smoke run
    python bench/context_parallel.py --activation-checkpointing full --lengths 1024 2048 4096 8192
    python bench/context_parallel.py --device cuda --cps 1 2 --model mpt-125m \\
        --lengths 8192 16384 32768 --precision amp_bf16         # GPU rows (bench/gpu.sh)

Activation memory of a length = the largest peak memory during a step's forward and backward
minus what the rank held just before them (the model's and the optimizer's state; cp=1's
cached ALiBi bias, which training keeps, is dropped before the first step and sized as for
max_seq_len = the length, so each length is charged for its own: `_bias_for`); the optimizer's
update after them allocates only state-sized temporaries, not activations. On a GPU the peak
is torch's allocator peak (`max_memory_allocated`). On CPU it is the process's resident peak
(VmHWM, reset through /proc/self/clear_refs before the step), with MALLOC_MMAP_THRESHOLD_ low so
every large tensor is its own mapping, returned to the system when freed, so resident memory
follows the live tensors (as tests/planning/peak_worker.py measures the planner's peaks):
tracemalloc sees only Python's own allocations, not torch's, and torch 2.13 keeps no allocator
statistics for CPU tensors. The gradients (sharded over the cp ranks as the parameters are) and
FSDP's gathered layer are inside that peak too: the state per rank is printed beside it.

The targets (issue 36): activation memory per rank at cp=C within 1.25 x (cp=1's) / C at the
longest length, and the longest length that trains in cp=1's memory at length L growing about
C-fold (here L = the longest length / the largest C, and the length whose activation memory is
cp=1's at L interpolated between the two measured around it: `reach_at`). Step time per length:
the mean of the steps after the first.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hydra.utils import instantiate

from llmfoundry.config.preflight import compose_config
from llmfoundry.distributed import FSDP
from llmfoundry.models.families import build_model

ROOT = Path(__file__).resolve().parents[1]
TARGET_RATIO = 1.25  # activation memory at cp=C within this x (cp=1's) / C


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    parser.add_argument("--model", default="mpt-tiny", help="a conf/model name")
    parser.add_argument("--layers", type=int, default=None, help="override n_layers")
    parser.add_argument("--batch", type=int, default=1, help="sequences per step")
    parser.add_argument("--steps", type=int, default=2, help="per length (the first untimed)")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "amp_bf16"])
    parser.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (nccl)")
    parser.add_argument(
        "--activation-checkpointing", default="none", choices=["none", "full", "selective"],
        help="strategy.activation_checkpointing (full: what long contexts train with)",
    )  # fmt: skip
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    # Read by each spawned process as it starts (module docstring: freed tensors leave RSS).
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    rows = {cp: run_job(cp, args) for cp in args.cps}
    print(report(rows, args))
    return 0


def run_job(cp: int, args: argparse.Namespace) -> dict[int, dict]:
    """One job of `cp` spawned processes; rank 0's rows by length."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "rows.json"
        mp.start_processes(_rank, args=(cp, args, port, str(out)), nprocs=cp, start_method="spawn")
        return {row["seq_len"]: row for row in json.loads(out.read_text())}


def _rank(rank: int, cp: int, args: argparse.Namespace, port: int, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(cp), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
    torch.set_num_threads(1)
    rows = run_rank(args)
    if rank == 0:
        Path(out).write_text(json.dumps(rows))


class Peak:
    """Peak memory of this process above its level at `start` (module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.base = device, 0

    def start(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
            return
        self.base = _status("VmRSS:")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := the current resident size

    def read(self) -> int:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device) - self.base
        return _status("VmHWM:") - self.base


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))


def run_rank(args: argparse.Namespace) -> list[dict]:
    """For each length, the activation memory and step time (each the most of any cp rank)."""
    cp = int(os.environ["WORLD_SIZE"])
    strategy = FSDP(
        device=args.device,
        parallelism={"cp": cp},
        activation_checkpointing=args.activation_checkpointing,
    )
    strategy.setup()
    device = strategy.device
    torch.manual_seed(0)
    overrides = [f"model={args.model}", f"model.max_seq_len={max(args.lengths)}"]
    if args.layers:
        overrides.append(f"model.n_layers={args.layers}")
    config = instantiate(compose_config(ROOT / "conf", overrides).model)
    model = strategy.prepare(build_model(config, init_device="meta"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    state = sum(p.to_local().numel() * p.element_size() for p in model.parameters()) * 4
    generator = torch.Generator().manual_seed(0)  # every cp rank reads the same batch
    autocast = torch.autocast(device.type, torch.bfloat16, enabled=args.precision == "amp_bf16")

    def forward_backward(ids: torch.Tensor) -> None:
        batch = {"input_ids": ids, "labels": ids}
        local = strategy.context.shard(batch) if strategy.context else batch
        with autocast:
            logits = model(local) if strategy.context else model(ids)
            loss = model.loss(logits, local)
        loss.backward()

    def update() -> None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def new_batch(seq_len: int) -> torch.Tensor:
        ids = torch.randint(0, config.vocab_size, (args.batch, seq_len), generator=generator)
        return ids.to(device)

    forward_backward(new_batch(min(args.lengths)))  # loads every kernel
    update()  # creates the optimizer state
    peak, rows = Peak(device), []
    for seq_len in sorted(args.lengths):
        ids = new_batch(seq_len)
        peaks, seconds = [], []
        for index in range(args.steps):
            if index == 0:
                _bias_for(model, seq_len)
            peak.start()
            start = time.perf_counter()
            forward_backward(ids)
            peaks.append(peak.read())
            update()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds.append(time.perf_counter() - start)
        timed = seconds[1:] or seconds
        measured = torch.tensor([float(max(peaks)), sum(timed) / len(timed)], device=device)
        dist.all_reduce(measured, op=dist.ReduceOp.MAX)
        rows.append({"cp": cp, "seq_len": seq_len, "activation_bytes": measured[0].item(),
                     "step_s": measured[1].item(), "state_bytes": state})  # fmt: skip
    strategy.teardown()
    return rows


def _bias_for(model: torch.nn.Module, seq_len: int) -> None:
    """cp=1's dense kernels keep the causal (ALiBi) bias cached, sized by the model's
    max_seq_len (`AttentionMasks`): size it as for a model of max_seq_len=`seq_len` and drop
    the cache, so the length's first step builds, and is charged for, the bias its training
    would keep (the later steps reuse it, as training does)."""
    masks = model.transformer.masks
    masks.max_seq_len, masks.cached = seq_len, None


def report(rows: dict[int, dict[int, dict]], args: argparse.Namespace) -> str:
    """The table (one row per length, one column pair per cp), the ratios against cp=1, and
    the targets."""
    mib = 2**20
    lengths = sorted(args.lengths)
    cps = sorted(rows)
    lines = [f"{args.model} {args.precision} batch {args.batch} on {args.device}, activation "
             f"checkpointing {args.activation_checkpointing}: activation memory per rank (MiB) "
             "and step time (s); ratio = cp=1's / this"]  # fmt: skip
    header = f"{'seq':>7}" + "".join(f" | cp={c}: {'MiB':>8} {'s':>7} {'ratio':>5}" for c in cps)
    lines += [header, "-" * len(header)]
    for seq in lengths:
        line = f"{seq:>7}"
        for c in cps:
            row = rows[c].get(seq)
            base = rows.get(1, {}).get(seq)
            ratio = base["activation_bytes"] / row["activation_bytes"] if base and row else None
            mem = f"{row['activation_bytes'] / mib:8.1f} {row['step_s']:7.2f}" if row else " " * 16
            line += f" | cp={c}: {mem} {ratio or 0:5.2f}"
        lines.append(line)
    state = rows[cps[0]][lengths[0]]["state_bytes"] if rows[cps[0]] else 0
    lines.append(
        f"state (parameters, gradients, Adam) per rank at cp={cps[0]}: {state / mib:.1f} MiB"
    )
    lines += targets(rows, lengths)
    return "\n".join(lines)


def targets(rows: dict[int, dict[int, dict]], lengths: list[int]) -> list[str]:
    """The two targets (module docstring), against cp=1 of the same run."""
    if 1 not in rows:
        return ["targets: not checked (no cp=1 rows)"]
    longest, out = lengths[-1], []
    one = rows[1][longest]["activation_bytes"]
    for c in sorted(rows):
        if c == 1:
            continue
        mem = rows[c][longest]["activation_bytes"]
        bound = TARGET_RATIO * one / c
        verdict = "met" if mem <= bound else "MISSED"
        out.append(f"target cp={c} at {longest}: {mem / 2**20:.1f} MiB <= 1.25 x {one / 2**20:.1f} "
                   f"/ {c} = {bound / 2**20:.1f} MiB: {verdict}")  # fmt: skip
    cmax = max(rows)
    at = next((n for n in lengths if n * cmax >= longest), lengths[0])
    budget = rows[1][at]["activation_bytes"]
    for c in sorted(rows):
        reach = reach_at(budget, [(n, rows[c][n]["activation_bytes"]) for n in lengths])
        shown = f"{reach:.0f} ({reach / at:.1f}x)" if reach else "none measured"
        if reach == lengths[-1] and rows[c][lengths[-1]]["activation_bytes"] < budget:
            shown = f"more than {lengths[-1]} (>{lengths[-1] / at:.1f}x)"
        out.append(f"longest length in cp=1's memory at {at} ({budget / 2**20:.1f} MiB): "
                   f"cp={c}: {shown}")  # fmt: skip
    return out


def reach_at(budget: float, measured: list[tuple[int, float]]) -> float:
    """The length whose activation memory is `budget`, interpolated linearly between the two
    measured (length, bytes) points around it (memory rises with length); the longest measured
    length if all are under it, 0 if none is."""
    under = [(n, m) for n, m in measured if m <= budget]
    if not under:
        return 0.0
    (n0, m0), above = under[-1], [(n, m) for n, m in measured if m > budget and n > under[-1][0]]
    if not above:
        return float(n0)
    n1, m1 = above[0]
    return n0 + (budget - m0) / (m1 - m0) * (n1 - n0)


if __name__ == "__main__":
    raise SystemExit(main())

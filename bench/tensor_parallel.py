"""Tensor-parallel throughput: a model (any conf/model: Llama, or MPT with its fused Wqkv
exchanged by head) trained under `strategy=fsdp parallelism.tp=T` on the processes torchrun
started (bench/gpu.sh's tp rows, beside a tp=1 row on the same GPUs).

A bare loop (forward, the chunked loss on vocabulary-sharded logits, backward, AdamW) over the
FSDP strategy with bf16 mixed precision; random tokens, one batch per data-parallel rank. Prints
one row on rank 0: mesh, tokens/s (whole job, and per GPU), MFU against the device's datasheet
peak (llmfoundry/callbacks/peak_flops.py), and the largest peak memory of any rank. Wall-clock
timing between synchronisations, after --warmup steps.

    torchrun --nproc_per_node=2 bench/tensor_parallel.py --tp 2
    torchrun --nproc_per_node=2 bench/tensor_parallel.py --tp 1          # FSDP alone, to compare
    torchrun --nproc_per_node=2 bench/tensor_parallel.py --tp 2 --model mpt-1b
    torchrun --nproc_per_node=2 bench/tensor_parallel.py --tp 2 --model llama-tiny --device cpu \\
        --seq-len 256 --batch 2 --steps 2 --warmup 1                     # a CPU smoke run
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from hydra.utils import instantiate

from llmfoundry.callbacks.peak_flops import device_peak_flops
from llmfoundry.config.preflight import compose_config
from llmfoundry.distributed import FSDP
from llmfoundry.models.families import build_model

CONF = Path(__file__).resolve().parents[1] / "conf"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--model", default="llama3-1b", help="a conf/model name")
    parser.add_argument("--layers", type=int, default=None, help="override n_layers")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4, help="per data-parallel rank")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", default="auto")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    strategy = FSDP(device=args.device, mixed_precision="bf16", parallelism={"tp": args.tp})
    strategy.setup()
    device = strategy.device
    overrides = [f"model={args.model}", f"max_seq_len={args.seq_len}"]
    if args.layers:
        overrides.append(f"model.n_layers={args.layers}")
    config = instantiate(compose_config(CONF, overrides).model)
    model = build_model(config, init_device="meta")
    flops = model.flops_per_token(args.seq_len)
    torch.manual_seed(0)
    model = strategy.prepare(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    generator = torch.Generator().manual_seed(strategy.dp_rank)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq_len), generator=generator)
    ids = ids.to(device)
    cuda = device.type == "cuda"

    def step() -> None:
        loss = model.loss(model(ids), ids)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)
        strategy.barrier()

    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(args.warmup):
        step()
    sync()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    sync()
    seconds = time.perf_counter() - start
    peak_mem = torch.tensor(
        float(torch.cuda.max_memory_allocated(device) if cuda else 0), device=device
    )
    dist.all_reduce(peak_mem, op=dist.ReduceOp.MAX)
    tokens_per_sec = args.steps * args.batch * args.seq_len * strategy.dp_size / seconds
    if strategy.rank == 0:
        peak, source = device_peak_flops(device, "amp_bf16")
        per_gpu = tokens_per_sec / strategy.world_size
        mfu = "n/a" if peak is None else f"{per_gpu * flops / peak:.1%}"
        mesh = " x ".join(f"{k}={v}" for k, v in strategy.dims.shape().items())
        print(f"{args.model} seq {args.seq_len} batch/dp {args.batch} [{mesh}]: "
              f"{tokens_per_sec:,.0f} tokens/s ({per_gpu:,.0f}/GPU), MFU {mfu} ({source}), "
              f"peak mem {peak_mem.item() / 2**30:.1f} GiB", flush=True)  # fmt: skip
    strategy.teardown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

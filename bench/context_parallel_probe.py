"""Does torch's context parallel (ring attention) run with our attention on this machine?

`torch.distributed.tensor.experimental.context_parallel` shards the sequence of the buffers it
is given across a device mesh and, inside its context, swaps F.scaled_dot_product_attention for
a ring version that passes key/value shards around the ranks. This probe asks it four things,
each against the same attention computed unsharded on every rank:

  1. causal   : plain causal SDPA (is_causal=True), what Llama's `sdpa` kernel calls;
  2. math     : the same with SDPA's math backend forced (what runs where no fused kernel does);
  3. bias     : SDPA with an additive float bias (MPT's ALiBi, document masks, sliding window);
  4. llama    : a forward and backward of a tiny Llama through our `sdpa` attention (the loss
                is not compared: positions and the label shift would need sharding too).

Each prints ok with the largest difference from the unsharded result, or the first line of the
error it raised. Run it on 2 processes:

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 bench/context_parallel_probe.py           # CPU, gloo
    torchrun --nproc-per-node 2 bench/context_parallel_probe.py --device cuda               # GPUs, nccl

On CPU (torch 2.13.0+cpu, gloo, 2026-12-03): causal and llama fail with "Operator
aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding strategy
registered", math with "aten.add.Tensor got mixed torch.Tensor and DTensor", and bias gave a
WRONG result (max difference 3.59) in one run and did not return in 400 s in another. That is
why `parallelism.cp` is refused (llmfoundry/distributed/fsdp.py).
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.experimental import context_parallel
from torch.distributed.tensor.experimental._attention import context_parallel_unshard
from torch.nn.attention import SDPBackend, sdpa_kernel

from llmfoundry.distributed.base import materialize
from llmfoundry.models.families import build_model
from llmfoundry.models.llama import LlamaConfig

SEQ, HEADS, HEAD_DIM = 64, 4, 16
# fp32 attention over 64 keys, summed in another order: differences of about 1e-6.
TOLERANCE = 1e-4


def probe(name: str, run: Callable[[], float], rank: int) -> None:
    try:
        difference = run()
        verdict = "ok" if difference < TOLERANCE else "WRONG result"
        line = f"{name:7s} {verdict}: max |cp - full| = {difference:.2e}"
    except Exception as err:  # the probe reports whatever torch raises
        line = f"{name:7s} failed: {type(err).__name__}: {(str(err).splitlines() or [''])[0][:200]}"
    if rank == 0:
        print(line, flush=True)


def attention_against_full(mesh, device: torch.device, bias: bool, math: bool = False) -> float:
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, HEADS, SEQ, HEAD_DIM, device=device) for _ in range(3))
    mask = None
    if bias:
        distance = torch.arange(SEQ)[:, None] - torch.arange(SEQ)[None, :]
        mask = (-0.5 * distance).masked_fill(distance < 0, float("-inf")).to(device)[None, None]
    full = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
    buffers = [q, k, v] if mask is None else [q, k, v, mask]
    backend = sdpa_kernel(SDPBackend.MATH) if math else contextlib.nullcontext()
    with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2] * len(buffers)), backend:
        local = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
    # Gathered back in sequence order (context_parallel load-balances: each rank holds a head
    # and a tail chunk).
    (whole,) = context_parallel_unshard(mesh, [local], [2])
    return (whole - full).abs().max().item()


def llama_runs(mesh, device: torch.device) -> float:
    config = LlamaConfig(d_model=64, n_heads=4, n_kv_heads=2, n_layers=2, vocab_size=128,
                         max_seq_len=SEQ, multiple_of=32, attn_impl="sdpa")  # fmt: skip
    torch.manual_seed(0)
    model = materialize(build_model(config, init_device="meta"), device)
    ids = torch.randint(0, 128, (1, SEQ), device=device)
    with context_parallel(mesh, buffers=[ids], buffer_seq_dims=[1]):
        model.loss(model(ids), ids).backward()
    return 0.0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = p.parse_args()
    rank = int(os.environ["RANK"])
    device = torch.device(
        args.device, int(os.environ["LOCAL_RANK"]) if args.device == "cuda" else 0
    )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    mesh = init_device_mesh(args.device, (dist.get_world_size(),), mesh_dim_names=("cp",))
    if rank == 0:
        print(f"torch {torch.__version__}, {mesh.size()} ranks on {args.device} "
              f"({dist.get_backend()}), sequence {SEQ}", flush=True)  # fmt: skip
    probe("causal", lambda: attention_against_full(mesh, device, bias=False), rank)
    probe("math", lambda: attention_against_full(mesh, device, bias=False, math=True), rank)
    probe("bias", lambda: attention_against_full(mesh, device, bias=True), rank)
    probe("llama", lambda: llama_runs(mesh, device), rank)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

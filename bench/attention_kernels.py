"""sdpa's planned backend beside what it ran before the plan, per mask case, in one run.

Before `attention.sdpa_plan`, `sdpa_attention` passed every bias to SDPA with enable_gqa, and
SDPA chose: a bias rules out flash and the efficient kernel refuses grouped-query heads, so
grouped heads with any bias (documents, a decoding step, a window, ALiBi) ran the math kernel,
which materialises [B, H, Lq, Lk] scores. Each row times the old call (`before`, rebuilt here
from the same mask) and today's `sdpa_attention` (`planned`, its one backend enforced on CUDA)
on the same tensors: forward and backward for training shapes, forward for decoding steps,
median milliseconds of `--repeats`, peak memory above the inputs, and their ratios.

    PYTHONPATH=. python bench/attention_kernels.py               # CUDA, bf16, seq 2048
    PYTHONPATH=. python bench/attention_kernels.py --device cpu  # tiny shapes: runs, no timing
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from llmfoundry.models.layers.attention import (
    AttentionMask,
    AttentionMasks,
    plan_for,
    sdpa_attention,
)
from llmfoundry.models.layers.position import ALiBi

# name: (heads, kv_heads, head_dim, alibi, documents, q_len (None: all), batch)
CASES = {
    "llama causal": (32, 8, 128, False, False, None, 4),
    "llama documents": (32, 8, 128, False, True, None, 4),
    "mpt alibi": (12, 12, 64, True, False, None, 8),
    "mpt alibi, grouped kv": (12, 4, 64, True, False, None, 8),
    "llama decoding step": (32, 8, 128, False, False, 1, 32),
    "llama decoding step, padded": (32, 8, 128, False, True, 1, 32),
}


def before(q, k, v, mask: AttentionMask) -> torch.Tensor:  # noqa: ANN001
    """`sdpa_attention` as it was: any bias in, grouped heads as they are, SDPA chooses."""
    bias = mask.dense_bias(q.shape[-2], k.shape[-2])
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=bias, is_causal=bias is None, enable_gqa=k.shape[1] != q.shape[1]
    )


def measure(run: Callable[[], None], device: torch.device, repeats: int) -> tuple[float, int]:
    """(median milliseconds, peak bytes allocated above the start) of `run`."""
    run()  # warm-up (and any lazily built bias)
    times, base = [], 0
    if device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    peak = torch.cuda.max_memory_allocated() - base if device.type == "cuda" else 0
    return statistics.median(times), peak


def case_row(name: str, seq: int, device: torch.device, dtype: torch.dtype, repeats: int) -> dict:
    heads, kv_heads, head_dim, alibi, documents, q_len, batch = CASES[name]
    masks = AttentionMasks(heads, seq, ALiBi(8) if alibi else None)
    sid = None
    if documents:  # left padding, then the text: what batched decoding passes
        sid = torch.arange(seq, device=device) >= torch.arange(batch, device=device)[:, None] * 8
        sid = sid.long()
    q_len = q_len or seq
    train = q_len == seq
    q = torch.randn(batch, heads, q_len, head_dim, device=device, dtype=dtype)
    k, v = (torch.randn(batch, kv_heads, seq, head_dim, device=device, dtype=dtype) for _ in "kv")
    for t in (q, k, v):
        t.requires_grad_(train)
    row = {"case": name, "plan": plan_for(q, k, masks(sid, device, dtype), 0.0).kernel}
    for label, fn in (("before", before), ("planned", sdpa_attention)):
        mask = masks(sid, device, dtype)

        def run(fn=fn, mask=mask) -> None:
            with torch.set_grad_enabled(train):
                out = fn(q, k, v, mask) if fn is before else fn(q, k, v, mask, 0.0, None)
                if train:
                    out.backward(torch.ones_like(out))

        row[f"{label}_ms"], row[f"{label}_peak_bytes"] = measure(run, device, repeats)
    row["speedup"] = round(row["before_ms"] / row["planned_ms"], 2)
    if row["planned_peak_bytes"]:
        row["memory_ratio"] = round(row["before_peak_bytes"] / row["planned_peak_bytes"], 2)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    args = parser.parse_args()
    device = torch.device(args.device)
    seq, dtype = (args.seq, torch.bfloat16) if device.type == "cuda" else (64, torch.float32)
    for name in args.cases:
        print(json.dumps(case_row(name, seq, device, dtype, args.repeats)), flush=True)


if __name__ == "__main__":
    main()

"""The next-token loss and evaluation's metrics over a step's logits: ours against the plain
formulation, measured in the same run.

  loss : forward + backward of the loss sum. Ours: `llmfoundry.core.loss` (row chunks sized for
         the device, one float32 temporary per chunk). Baseline: `F.cross_entropy` of the
         shifted logits upcast to float32, as a plain training loop writes it.
  eval : one metrics update. Ours: `LanguageMetrics.update` (each position's loss and argmax
         read chunk by chunk in the logits' dtype). Baseline: what it did before, the shifted
         logits upcast to float32, per-token `F.cross_entropy` and the argmax of the copy.

Each row prints one JSON line: time per call (median of --repeats after one warm-up; CUDA: wall
time between synchronisations; CPU: this process's CPU time, which other jobs on a shared
machine distort much less), and on CUDA the kernels launched per call (torch.profiler) and the
peak memory allocated above the logits, in units of one bf16 logits tensor (the issue's target
for evaluation: at most 0.2 above it, today's formulation 4); ours/baseline ratios last. On the
CPU, launches and memory are counted by the tests instead (tests/models/test_mpt_loss.py,
tests/trainer/test_eval_memory.py).

    PYTHONPATH=. python bench/loss_memory.py                              # CPU, 2 x 512 x 50,368
    PYTHONPATH=. python bench/loss_memory.py --device cuda                # mpt-125m: 16 x 2048
    PYTHONPATH=. python bench/loss_memory.py --device cuda --batch 8 --vocab 128256   # Llama 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from llmfoundry.core.loss import next_token_loss_sum
from llmfoundry.core.metrics import IGNORE_INDEX, LanguageMetrics


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--batch", type=int, help="rows (default: 16 on cuda, 2 on cpu)")
    p.add_argument("--seq-len", type=int, help="positions (default: 2048 on cuda, 512 on cpu)")
    p.add_argument("--vocab", type=int, default=50368, help="vocabulary (default MPT's 50,368)")
    p.add_argument("--repeats", type=int, default=5, help="timed calls per side (default 5)")
    args = p.parse_args(argv)
    cuda = args.device.startswith("cuda")
    args.batch = args.batch or (16 if cuda else 2)
    args.seq_len = args.seq_len or (2048 if cuda else 512)
    if min(args.batch, args.seq_len, args.vocab, args.repeats) < 1:
        p.error("--batch, --seq-len, --vocab and --repeats must be positive")
    if cuda and not torch.cuda.is_available():
        p.error(f"--device {args.device}: no CUDA device is visible")
    return args


def baseline_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    flat = logits[:, :-1].flatten(0, 1).float()
    return F.cross_entropy(flat, labels[:, 1:].flatten(), reduction="sum")


def baseline_update(metrics: LanguageMetrics, logits: torch.Tensor, labels: torch.Tensor) -> None:
    """`LanguageMetrics.update` as it was: the shifted logits upcast whole."""
    upcast = logits[:, :-1].float()
    targets = labels[:, 1:]
    token_loss = F.cross_entropy(
        upcast.reshape(-1, upcast.size(-1)), targets.reshape(-1), reduction="none"
    )
    correct = ((upcast.argmax(-1) == targets) & (targets != IGNORE_INDEX)).sum()
    metrics.totals += torch.stack(
        [token_loss.double().sum(), (targets != IGNORE_INDEX).sum().double(), correct.double()]
    )


def seconds(call: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median time of `call` after one warm-up call."""
    call()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            start = time.perf_counter()
            call()
            torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
        else:
            start = time.process_time()
            call()
            times.append(time.process_time() - start)
    return statistics.median(times)


def cuda_counts(call: Callable[[], object], device: torch.device) -> tuple[int, int]:
    """Kernels one call launches, and the bytes it allocates at its peak above what was
    allocated before it."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize(device)
    kernels = sum(
        1 for event in prof.events() if event.device_type == torch.autograd.DeviceType.CUDA
    )
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    call()
    torch.cuda.synchronize(device)
    return kernels, torch.cuda.max_memory_allocated(device) - before


def measure(
    row: str, sides: dict[str, Callable[[], object]], logits_bytes: int, args, device
) -> dict:
    result: dict = {
        "row": row,
        "device": str(device),
        "shape": [args.batch, args.seq_len, args.vocab],
    }
    for side, call in sides.items():
        result[f"{side}_ms"] = round(seconds(call, device, args.repeats) * 1e3, 2)
        if device.type == "cuda":
            kernels, peak = cuda_counts(call, device)
            result[f"{side}_kernels"] = kernels
            result[f"{side}_peak_over_bf16_logits"] = round(peak / logits_bytes, 3)
    for key in [k.removeprefix("ours_") for k in result if k.startswith("ours_")]:
        ours, baseline = result[f"ours_{key}"], result[f"baseline_{key}"]
        result[f"ratio_{key}"] = round(ours / baseline, 3) if baseline else None
    return result


def main(argv: Sequence[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    device = torch.device(args.device)
    gen = torch.Generator(device).manual_seed(0)
    shape = (args.batch, args.seq_len, args.vocab)
    logits = torch.randn(shape, generator=gen, device=device).to(torch.bfloat16)
    labels = torch.randint(0, args.vocab, shape[:2], generator=gen, device=device)
    logits_bytes = logits.numel() * logits.element_size()
    trained = logits.clone().requires_grad_()

    def backward(loss_fn: Callable) -> Callable[[], None]:
        def call() -> None:
            trained.grad = None
            loss_fn(trained, labels).backward()

        return call

    metrics = LanguageMetrics(device)
    everyone = torch.ones(args.batch, dtype=torch.bool, device=device)
    rows = [
        measure(
            "loss",
            {"ours": backward(next_token_loss_sum), "baseline": backward(baseline_loss)},
            logits_bytes,
            args,
            device,
        ),
        measure(
            "eval",
            {
                "ours": lambda: metrics.update(logits, {"labels": labels}, everyone),
                "baseline": lambda: baseline_update(metrics, logits, labels),
            },
            logits_bytes,
            args,
            device,
        ),
    ]
    for row in rows:
        print(json.dumps(row), flush=True)
    return rows


if __name__ == "__main__":
    main()

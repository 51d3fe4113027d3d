"""Training throughput: our trainer, our model and transformers' MPT, in interleaved rounds.

Three sides train the same shape on the same batch size, sequence length, precision, optimizer
(DecoupledAdamW over `build_param_groups`, lr 1e-3) and gradient clipping (norm 1.0, the recipe's
default algorithm), on the same number of threads:

  a  trainer : `build_trainer` on synthetic MDS data with conf/train.yaml's default algorithms,
               callbacks and loggers (speed monitor, lr monitor, runtime estimator, NaN detector,
               sample generation at fit end; console, progress bar, JSONL), checkpoints off;
  b  hf      : transformers' `MptForCausalLM` (loss from `labels=`) in a bare loop;
  c  ours    : our `MPTForCausalLM` (+ `MPTForCausalLM.loss`) in the same bare loop.

One process; the trainer drives the rounds: a callback ends a trainer round every
`--steps-per-round` batches and there runs one round of each bare side (b and c in alternating
order), so every side sees the same machine state in turn. The first round of each side is warm-up
and discarded; evaluation inside the trainer's rounds is subtracted. Medians over rounds are
printed, with the medians of the per-round ratios c/b (ours over transformers) and a/c (trainer
over bare loop; 1 - a/c is the trainer's overhead), and the same ratios of each side's best round.

The clock is this process's CPU time when one thread is used (the default): on a shared machine
other jobs then distort it much less than wall time. MFU is model flops (`flops_per_token`,
6N + 12 L d s) per second over the best square-matmul flop/s of the same dtype and threads,
measured in the same run (llmfoundry/callbacks/peak_flops.py).

    python bench/train_throughput.py                        # 2 shapes x fp32/bf16, a few minutes
    python bench/train_throughput.py --shape mpt-50m --precision amp_bf16 --rounds 6
    python bench/train_throughput.py --model mpt-125m --seq-len 2048 --batch 1 --override \\
        model.n_layers=2                                    # any conf/model with overrides

`--gpu` (what bench/gpu.sh runs) measures instead our model's bare loop on one accelerator:
mpt-125m, mpt-350m and mpt-1b at sequence 2048 in amp_bf16, with every attention kernel this
install can use (sdpa, flex, flash), torch.compile of the blocks off and on, and prints tokens/s,
MFU against the device's datasheet peak (llmfoundry/callbacks/peak_flops.py) and peak memory.
The microbatch is the planner's largest fitting 60% of the device memory (capped at 16), unless
--batch is given. Wall-clock timing between CUDA synchronisations, after --warmup steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
from hydra.utils import instantiate

from llmfoundry.build import build_trainer
from llmfoundry.callbacks.peak_flops import device_peak_flops, measure_cpu_peak_flops
from llmfoundry.config.preflight import compose_config
from llmfoundry.core.engine import Callback, Logger
from llmfoundry.core.precision import Precision
from llmfoundry.core.state import State
from llmfoundry.data.mds import MDSWriter
from llmfoundry.models.converters import ConversionContext, Float8Training, float8_refusal
from llmfoundry.models.layers.kernels import check_attn_impl
from llmfoundry.models.mpt import MPTConfig, MPTForCausalLM
from llmfoundry.models.mpt.hf import to_hf_config
from llmfoundry.optim import DecoupledAdamW
from llmfoundry.optim.param_groups import build_param_groups
from llmfoundry.planning import Setup, largest_microbatch

CONF = Path(__file__).resolve().parents[1] / "conf"
LR, CLIP = 1e-3, 1.0

# The CPU shapes of the benchmark: (conf/model name, model overrides, seq_len, batch, steps per
# round). About 4 CPU-minutes for both shapes and precisions on one core.
SHAPES: dict[str, tuple[str, list[str], int, int, int]] = {
    "mpt-tiny": ("mpt-tiny", [], 256, 16, 2),
    # ~51M parameters: 25M in the blocks, 26M in the tied 50k-vocabulary embedding.
    "mpt-50m": (
        "mpt-125m",
        ["model.d_model=512", "model.n_heads=8", "model.n_layers=8", "model.max_seq_len=512"],
        512,
        2,
        1,
    ),
}
PRECISIONS = ("fp32", "amp_bf16")
GPU_MODELS = ("mpt-125m", "mpt-350m", "mpt-1b")
GPU_ATTN_IMPLS = ("sdpa", "flex", "flash")
GPU_SEQ_LEN, GPU_MAX_BATCH, GPU_MEMORY_SHARE = 2048, 16, 0.6


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--shape", choices=sorted(SHAPES), action="append", help="a CPU shape (default: both)"
    )
    p.add_argument("--model", help="a conf/model name instead of --shape (with --seq-len, --batch)")
    p.add_argument("--override", nargs="*", default=[], help="model.key=value overrides")
    p.add_argument("--seq-len", type=int, help="sequence length (with --model)")
    p.add_argument("--batch", type=int, help="rows per step (default: the shape's)")
    p.add_argument(
        "--precision", choices=PRECISIONS, action="append", help="default: fp32 and amp_bf16"
    )
    p.add_argument("--rounds", type=int, default=4, help="timed rounds after warm-up (default 4)")
    p.add_argument(
        "--steps-per-round", type=int, help="steps per side per round (default: the shape's; 2)"
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--sides", default="abc", help="which sides to run (default abc)")
    gpu = p.add_argument_group("--gpu: our model alone on one accelerator")
    gpu.add_argument("--gpu", action="store_true", help="run the GPU suite instead")
    gpu.add_argument("--device", default="cuda", help="device of the GPU suite (default cuda)")
    gpu.add_argument("--gpu-models", nargs="+", default=list(GPU_MODELS), help="conf/model names")
    gpu.add_argument("--attn-impls", nargs="+", default=list(GPU_ATTN_IMPLS))
    gpu.add_argument("--compile", choices=("off", "on", "both"), default="both")
    gpu.add_argument("--warmup", type=int, default=3, help="untimed steps (default 3)")
    gpu.add_argument("--steps", type=int, default=10, help="timed steps (default 10)")
    gpu.add_argument("--json-out", type=Path, help="also write the rows to this JSON file")
    gpu.add_argument(
        "--gpu-precisions", nargs="+", choices=("amp_bf16", "amp_fp8"), default=["amp_bf16"],
        help="amp_fp8: bf16 autocast + torchao Float8Linear (compute capability 8.9+)",
    )  # fmt: skip
    args = p.parse_args(argv)
    if args.gpu:
        if args.shape or args.model:
            p.error("--gpu takes --gpu-models, not --shape or --model")
        if args.steps < 1 or args.warmup < 0 or (args.batch is not None and args.batch < 1):
            p.error("--steps and --batch must be positive, --warmup >= 0")
        return args
    if args.model and args.shape:
        p.error("use either --shape or --model, not both")
    if args.model and not args.seq_len:
        p.error("--model needs --seq-len")
    if args.rounds < 1 or (args.steps_per_round or 1) < 1 or args.threads < 1:
        p.error("--rounds, --steps-per-round and --threads must be positive")
    if not set(args.sides) <= set("abc") or not args.sides:
        p.error("--sides takes letters among a, b, c")
    return args


def configs(args: argparse.Namespace) -> list[tuple[str, str, list[str], int, int, int]]:
    """(label, conf model name, model overrides, seq_len, batch, steps per round) to run."""
    if args.model:
        label = f"{args.model}{'*' if args.override else ''}"
        steps = args.steps_per_round or 2
        return [(label, args.model, list(args.override), args.seq_len, args.batch or 1, steps)]
    out = []
    for name in args.shape or list(SHAPES):
        model, overrides, seq_len, batch, steps = SHAPES[name]
        out.append(
            (
                name,
                model,
                overrides + list(args.override),
                seq_len,
                args.batch or batch,
                args.steps_per_round or steps,
            )
        )
    return out


def write_data(root: Path, rows: int, seq_len: int, vocab_size: int) -> None:
    """Random token rows as MDS splits train/val, and a word-level tokenizer.json for samples."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    rng = np.random.default_rng(0)
    for split, n in (("train", rows), ("val", 8)):
        with MDSWriter(root / split, {"tokens": f"ndarray:uint16:{seq_len}"}) as writer:
            for _ in range(n):
                writer.write({"tokens": rng.integers(0, vocab_size, seq_len, dtype=np.uint16)})
    tokenizer = Tokenizer(WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tokenizer.pre_tokenizer = Whitespace()
    tokenizer.save(str(root / "tokenizer.json"))


def make_bare_step(
    model: torch.nn.Module, loss_fn: Callable, batch: dict, precision: Precision
) -> Callable[[], torch.Tensor]:
    """One training step of a bare loop: forward, loss, backward, clip, AdamW step."""
    optimizer = DecoupledAdamW(build_param_groups(model), lr=LR)
    params = [p for p in model.parameters() if p.requires_grad]

    def step() -> torch.Tensor:
        with precision.autocast():
            loss = loss_fn(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def ours_loss(model: MPTForCausalLM, batch: dict) -> torch.Tensor:
    return model.loss(model(batch["input_ids"]), batch["labels"])


def hf_loss(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    return model(input_ids=batch["input_ids"], labels=batch["labels"]).loss


def build_hf(model: MPTForCausalLM) -> torch.nn.Module:
    """transformers' MptForCausalLM with `model`'s weights (as llmfoundry.models.mpt.hf exports)."""
    import transformers

    hf = transformers.MptForCausalLM(to_hf_config(model.config))
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    state["lm_head.weight"] = state["transformer.wte.weight"]
    hf.load_state_dict(state, strict=True)
    hf.tie_weights()
    return hf.train()


class Rounds(Callback):
    """Times the trainer in rounds of `steps` batches and runs the bare sides between them."""

    def __init__(self, steps: int, clock: Callable[[], float], between: Callable[[int], None]):
        self.steps, self.clock, self.between = steps, clock, between
        self.times: list[float] = []
        self._start = 0.0
        self._eval_start = 0.0
        self._excluded = 0.0

    def fit_start(self, state: State, logger: Logger) -> None:
        self._start, self._excluded = self.clock(), 0.0

    def eval_before_all(self, state: State, logger: Logger) -> None:
        self._eval_start = self.clock()

    def eval_after_all(self, state: State, logger: Logger) -> None:
        self._excluded += self.clock() - self._eval_start

    def batch_end(self, state: State, logger: Logger) -> None:
        if state.timestamp.batch % self.steps:
            return
        self.times.append(self.clock() - self._start - self._excluded)
        self.between(len(self.times) - 1)
        self._start, self._excluded = self.clock(), 0.0


def run_config(
    label: str,
    model_name: str,
    overrides: list[str],
    seq_len: int,
    batch: int,
    steps: int,
    precision_name: str,
    args: argparse.Namespace,
    clock: Callable[[], float],
) -> dict[str, float]:
    """Time the requested sides on one shape and precision; print and return the medians."""
    model_overrides = [f"model={model_name}", *overrides, f"max_seq_len={seq_len}"]
    rounds = args.rounds
    n_batches = steps * (rounds + 1)
    root = Path(tempfile.mkdtemp(prefix="bench-throughput-"))
    try:
        cfg = compose_config(CONF, model_overrides)
        model_cfg: MPTConfig = instantiate(cfg.model)
        torch.manual_seed(0)
        ours = MPTForCausalLM(dataclasses.replace(model_cfg, init_device="cpu")).train()
        precision = Precision(precision_name, torch.device("cpu"))
        gen = torch.Generator().manual_seed(1)
        ids = torch.randint(0, model_cfg.vocab_size, (batch, seq_len), generator=gen)
        data = {"input_ids": ids, "labels": ids.clone()}
        bare: dict[str, Callable[[], torch.Tensor]] = {}
        if "c" in args.sides:
            bare["c"] = make_bare_step(ours, ours_loss, data, precision)
        if "b" in args.sides:
            hf = build_hf(ours)
            with torch.no_grad(), precision.autocast():
                want, got = ours_loss(ours, data), hf_loss(hf, data)
            if not torch.allclose(want.float(), got.float(), rtol=2e-2):
                raise SystemExit(f"ours and hf disagree on the loss ({want}, {got}): invalid")
            bare["b"] = make_bare_step(hf, hf_loss, data, precision)
        times: dict[str, list[float]] = {side: [] for side in args.sides}

        def run_bare(round_index: int) -> None:
            order = sorted(bare) if round_index % 2 == 0 else sorted(bare, reverse=True)
            for side in order:
                start = clock()
                for _ in range(steps):
                    bare[side]()
                times[side].append(clock() - start)

        if "a" in args.sides:
            write_data(root / "mds", batch * n_batches, seq_len, model_cfg.vocab_size)
            trainer_cfg = compose_config(
                CONF,
                [
                    *model_overrides,
                    f"data.remote={root / 'mds'}",
                    f"global_train_batch_size={batch}",
                    f"max_duration={n_batches}ba",
                    f"precision={precision_name}",
                    f"optimizer.lr={LR}",
                    "save_folder=null",
                    "run_name=bench",
                ],
            )
            trainer = build_trainer(trainer_cfg, root / "run")
            rounds_cb = Rounds(steps, clock, run_bare)
            trainer.state.callbacks.append(rounds_cb)
            trainer.fit()
            times["a"] = rounds_cb.times
        else:
            for index in range(rounds + 1):
                run_bare(index)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    tokens = steps * batch * seq_len
    rates = {side: [tokens / t for t in ts[1:]] for side, ts in times.items()}  # drop warm-up
    dtype = torch.bfloat16 if precision_name == "amp_bf16" else torch.float32
    peak = measure_cpu_peak_flops(dtype, args.threads, clock)
    flops = ours.flops_per_token(seq_len)
    names = {"a": "trainer (a)", "b": "transformers (b)", "c": "ours bare (c)"}
    print(
        f"\n== {label} seq {seq_len} batch {batch} ({steps} steps a round) {precision_name}: "
        f"{ours.num_params() / 1e6:.1f}M params, {flops / 1e6:.0f} MFLOP/token, peak "
        f"{peak / 1e9:.1f} GFLOP/s "
        f"({str(dtype)[6:]} matmul, {args.threads} thread(s))"
    )
    result: dict[str, float] = {}
    for side in sorted(rates):
        median = statistics.median(rates[side])
        result[side] = median
        print(f"  {names[side]:17s}: {median:9,.0f} tokens/s  MFU {median * flops / peak:6.1%}")
    for num, den, what in (("c", "b", "ours / transformers"), ("a", "c", "trainer / bare loop")):
        if num in rates and den in rates:
            ratio = statistics.median(x / y for x, y in zip(rates[num], rates[den], strict=True))
            best = max(rates[num]) / max(rates[den])
            result[f"{num}/{den}"] = ratio
            print(f"  {what:19s}: {ratio:6.3f}x (median of per-round ratios), {best:6.3f}x (best "
                  "rounds)")  # fmt: skip
    return result


def gpu_batch(model_cfg: MPTConfig, seq_len: int, device: torch.device) -> int:
    """The planner's largest microbatch in GPU_MEMORY_SHARE of the device (llmfoundry/planning)."""
    if device.type != "cuda":
        raise SystemExit(f"--batch is required on {device.type} (the planner sizes CUDA batches)")
    memory = torch.cuda.get_device_properties(device).total_memory * GPU_MEMORY_SHARE
    fits = largest_microbatch(Setup(model_cfg, seq_len, "amp_bf16"), memory)
    return max(1, min(GPU_MAX_BATCH, fits))


def gpu_run(
    model_cfg: MPTConfig,
    seq_len: int,
    batch: int,
    compiled: bool,
    args: argparse.Namespace,
    precision: str = "amp_bf16",
) -> tuple[float, float]:
    """(tokens/s, peak bytes) of our model's bare loop on args.device; amp_fp8 is amp_bf16 with
    the float8 converter, as `resolve_precision` spells it for training."""
    device = torch.device(args.device)
    model = MPTForCausalLM(dataclasses.replace(model_cfg, init_device="meta"))
    model.to_empty(device=device)
    model.init_weights()
    model.train()
    if precision == "amp_fp8":
        Float8Training().convert(model, ConversionContext("amp_bf16", device))
    if compiled:
        for block in model.transformer.blocks:
            block.compile()
    ids = torch.randint(0, model_cfg.vocab_size, (batch, seq_len), device=device)
    step = make_bare_step(model, ours_loss, {"input_ids": ids, "labels": ids}, Precision(
        "amp_bf16", device))  # fmt: skip
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(args.warmup):
        step()
    sync()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    sync()
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    return args.steps * batch * seq_len / seconds, peak


def gpu_suite(args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    seq_len = args.seq_len or GPU_SEQ_LEN
    if "amp_fp8" in args.gpu_precisions and (reason := float8_refusal(device)):
        raise SystemExit(f"--gpu-precisions amp_fp8: {reason}")
    peak, source = device_peak_flops(device, "amp_bf16")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    print(f"{name}, torch {torch.__version__}, {'/'.join(args.gpu_precisions)}, seq {seq_len}; "
          f"bf16 peak: {'unknown' if peak is None else f'{peak / 1e12:.1f} TFLOP/s'} ({source})")  # fmt: skip
    impls = []
    for impl in args.attn_impls:
        try:
            check_attn_impl(impl, "model")
            impls.append(impl)
        except ValueError as err:
            print(f"attention {impl}: skipped ({err})")
    modes = {"off": [False], "on": [True], "both": [False, True]}[args.compile]
    print(f"{'model':10s} {'attn':6s} {'compile':8s} {'batch':>5s} {'precision':9s} "
          f"{'tokens/s':>12s} {'MFU':>7s} {'peak mem':>10s}")  # fmt: skip
    rows: list[dict] = []
    for model_name in args.gpu_models:
        model_cfg = instantiate(compose_config(CONF, [f"model={model_name}"]).model)
        model_cfg = dataclasses.replace(model_cfg, max_seq_len=max(model_cfg.max_seq_len, seq_len))
        batch = args.batch or gpu_batch(model_cfg, seq_len, device)
        flops = MPTForCausalLM(dataclasses.replace(model_cfg, init_device="meta")).flops_per_token(
            seq_len
        )
        runs = [(i, c, p) for i in impls for c in modes for p in args.gpu_precisions]
        for impl, compiled, precision in runs:
            label = (f"{model_name:10s} {impl:6s} {'on' if compiled else 'off':8s} {batch:5d} "
                     f"{precision:9s}")  # fmt: skip
            try:
                cfg = dataclasses.replace(model_cfg, attn_impl=impl)
                tokens_per_sec, peak_mem = gpu_run(cfg, seq_len, batch, compiled, args, precision)
            except (RuntimeError, ValueError) as err:  # OOM, a kernel this device lacks
                error = str(err).splitlines()[0][:100]
                print(f"{label} failed: {error}")
                rows.append({"model": model_name, "attn_impl": impl, "compile": compiled,
                             "precision": precision, "error": error})  # fmt: skip
                continue
            finally:
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            mfu = None if peak is None else tokens_per_sec * flops / peak
            print(f"{label} {tokens_per_sec:12,.0f} {'n/a' if mfu is None else f'{mfu:.1%}':>7s} "
                  f"{peak_mem / 2**30:7.1f} GiB", flush=True)  # fmt: skip
            rows.append({"model": model_name, "attn_impl": impl, "compile": compiled,
                         "batch": batch, "seq_len": seq_len, "precision": precision,
                         "tokens_per_s": tokens_per_sec, "mfu": mfu,
                         "peak_memory_gib": peak_mem / 2**30})  # fmt: skip
    if args.json_out:
        args.json_out.write_text(json.dumps(rows, indent=1))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.gpu:
        return gpu_suite(args)
    torch.set_num_threads(args.threads)
    clock = time.process_time if args.threads == 1 else time.perf_counter
    clock_name = "process CPU time" if args.threads == 1 else "wall time"
    print(
        f"torch {torch.__version__}, {args.threads} thread(s), clock: {clock_name}, "
        f"{args.rounds} timed rounds per side after 1 warm-up round"
    )
    for label, model_name, overrides, seq_len, batch, steps in configs(args):
        for precision_name in args.precision or PRECISIONS:
            run_config(
                label, model_name, overrides, seq_len, batch, steps, precision_name, args, clock
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())

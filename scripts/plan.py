"""Plan a training run's memory and step time before renting the GPUs.

    python scripts/plan.py model=mpt-7b precision=amp_bf16 --strategy fsdp --world-size 8 \\
        --activation-checkpointing --device-memory 80GB
    python scripts/plan.py model=mpt-30b --strategy zero3 --world-size 64 --cpu-offload

The config is composed from conf/ exactly as scripts/train.py composes it (same key=value
overrides); the flags describe the cluster. Prints parameter count, flops per token, memory per
device by part at the config's microbatch, the largest microbatch that fits the device memory
(default: the detected GPU's), and the step time at a given MFU of the device's peak
(llmfoundry/planning.py says what each number counts). Impossible inputs are one line and exit
status 2 (`--debug` for the traceback). A setup in which not even one sequence
fits a device is an error (exit status 2) saying what would fit, with no step time.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hydra.errors import HydraException
from hydra.utils import instantiate

from llmfoundry.callbacks.peak_flops import gpu_peak_flops, number_format
from llmfoundry.config import validate_config
from llmfoundry.config.preflight import check, compose_config
from llmfoundry.planning import (
    STRATEGIES,
    Setup,
    largest_microbatch,
    optimizer_state_bytes,
    parse_bytes,
    plan_memory,
    step_seconds,
)
from llmfoundry.utils.cli import add_script_arguments, script_errors
from llmfoundry.utils.errors import UserError

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("overrides", nargs="*", help="config overrides, as for scripts/train.py")
    p.add_argument("--strategy", choices=STRATEGIES, default="single")
    p.add_argument("--world-size", type=int, default=1, help="devices in the run (default 1)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="for fsdp-hybrid (default 8)")
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--cpu-offload", action="store_true", help="optimizer (and shards) on host")
    p.add_argument("--device-memory", help="per device, e.g. 80GB (default: the detected GPU)")
    p.add_argument("--device-name", help="GPU name for its peak, e.g. H100 (default: detected)")
    p.add_argument("--peak-tflops", type=float, help="peak TFLOP/s per device (overrides name)")
    p.add_argument("--mfu", type=float, default=0.4, help="MFU for the step time (default 0.4)")
    p.add_argument("--microbatch", type=int, help="default: the config's microbatch or batch")
    add_script_arguments(p, storage=False)
    return p.parse_args(argv)


def detected_gpu() -> tuple[str | None, int | None]:
    import torch

    if not torch.cuda.is_available():
        return None, None
    props = torch.cuda.get_device_properties(0)
    return props.name, props.total_memory


def gib(n: float) -> str:
    return f"{n / 2**30:9.2f} GiB"


def _what_would_fit(args: argparse.Namespace) -> str:
    """The changes of the run that shrink memory per device and that this plan did not use."""
    options = []
    if args.strategy in ("single", "ddp", "zero1", "zero2"):
        options.append("shard the weights (--strategy fsdp or zero3) over more devices")
    else:
        options.append(f"more devices than --world-size {args.world_size}")
    if not args.activation_checkpointing:
        options.append("--activation-checkpointing")
    if not args.cpu_offload and args.strategy not in ("single", "ddp"):
        options.append("--cpu-offload")
    options.append("a shorter max_seq_len or larger devices")
    return "try " + ", ".join(options)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with script_errors(args):
        return plan(args)


def plan(args: argparse.Namespace) -> int:
    try:
        cfg = compose_config(CONF_DIR, args.overrides)
    except HydraException:
        check(CONF_DIR, args.overrides)  # raises the ConfigError naming the key and the fix
        raise
    settings = validate_config(cfg)
    model_cfg = instantiate(cfg.model)
    seq_len = settings.max_seq_len or model_cfg.max_seq_len
    if settings.global_train_batch_size % args.world_size:
        raise UserError(
            f"global_train_batch_size={settings.global_train_batch_size} is not divisible by "
            f"--world-size {args.world_size}"
        )
    device_batch = settings.global_train_batch_size // args.world_size
    configured = settings.device_train_microbatch_size
    microbatch = args.microbatch or (configured if isinstance(configured, int) else device_batch)
    setup = Setup(
        model=model_cfg,
        seq_len=seq_len,
        precision=settings.precision,
        strategy=args.strategy,
        world_size=args.world_size,
        gpus_per_node=args.gpus_per_node,
        activation_checkpointing=args.activation_checkpointing,
        cpu_offload=args.cpu_offload,
        optimizer_bytes=optimizer_state_bytes(cfg.optimizer._target_),
    )
    memory_plan = plan_memory(setup, microbatch)
    gpu_name, gpu_memory = detected_gpu()
    name = args.device_name or gpu_name
    memory = parse_bytes(args.device_memory) if args.device_memory else gpu_memory

    flags = [args.strategy, f"world size {args.world_size}"]
    flags += ["activation checkpointing"] * args.activation_checkpointing
    flags += ["CPU offload"] * args.cpu_offload
    print(f"model       : {cfg.model._target_.rsplit('.', 1)[-1]} d_model {model_cfg.d_model}, "
          f"{model_cfg.n_layers} layers, vocab {model_cfg.vocab_size}, seq {seq_len}")  # fmt: skip
    print(f"run         : {', '.join(flags)}; {settings.precision}; global batch "
          f"{settings.global_train_batch_size} ({device_batch} per device)")  # fmt: skip
    print(f"parameters  : {memory_plan.n_params:,}")
    print(f"flops/token : {memory_plan.flops_per_token / 1e9:.3f} GFLOP (6N + 12 L d s, fwd + bwd)")
    print(f"memory per device at microbatch {microbatch}:")
    for part in ("params", "grads", "optimizer", "working", "activations", "logits"):
        print(f"  {part:11s}: {gib(getattr(memory_plan, part))}")
    print(f"  {'total':11s}: {gib(memory_plan.total)}")
    if memory is None:
        print("largest microbatch: no GPU detected; pass --device-memory 80GB")
    else:
        size = args.device_memory or f"{memory / 1e9:.0f}GB"
        fits = largest_microbatch(setup, memory)
        if not fits:
            print(
                f"error: not even 1 sequence per device fits {size} ({gib(memory).strip()}): "
                f"microbatch 1 needs {gib(plan_memory(setup, 1).total).strip()}; "
                f"{_what_would_fit(args)}",
                file=sys.stderr,
            )
            return 2
        print(f"largest microbatch fitting {size} ({gib(memory).strip()}): {fits}")
    peak = args.peak_tflops * 1e12 if args.peak_tflops else None
    if peak is None and name:
        peak = gpu_peak_flops(name, number_format(settings.precision))
    if peak is None:
        print("step time   : unknown peak; pass --device-name H100 or --peak-tflops 989")
    else:
        seconds = step_seconds(
            memory_plan.flops_per_token,
            settings.global_train_batch_size,
            seq_len,
            args.world_size,
            peak,
            args.mfu,
        )
        tokens = settings.global_train_batch_size * seq_len / seconds
        print(f"step time   : {seconds:.3f} s at {args.mfu:.0%} MFU of {peak / 1e12:.1f} TFLOP/s "
              f"({tokens:,.0f} tokens/s in all)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Plan a training run's memory, communication and step time before renting the GPUs.

    python scripts/plan.py model=mpt-7b precision=amp_bf16 --strategy fsdp --world-size 8 \\
        --activation-checkpointing --device-memory 80GB
    python scripts/plan.py model=mpt-30b --strategy deepspeed_zero3 --world-size 64 --cpu-offload
    python scripts/plan.py model=llama3-70b precision=amp_bf16 max_seq_len=8192 \\
        global_train_batch_size=512 --strategy fsdp --world-size 64 --tp 8 --pp 2 \\
        --activation-checkpointing --device-memory 80GB --device-name H100
    python scripts/plan.py model=llama3-70b precision=amp_bf16 max_seq_len=8192 \\
        global_train_batch_size=512 --recommend --activation-checkpointing --device-memory 80GB

The config is composed from conf/ exactly as scripts/train.py composes it (same key=value
overrides); the flags describe the cluster and the mesh (`--strategy` by conf/strategy's names;
`--tp`, `--cp`, `--pp`, `--ep`, `--dp-replicate`, `--dp-shard` as the config's parallelism
block, built by llmfoundry/distributed/mesh.py's parallel_dims; `--schedule`,
`--stages-per-rank` for the pipeline), refused as training refuses them; `precision=auto` (the
default) plans what training resolves it to on the named or detected GPU (`planned_precision`).
Prints parameter count (a mixture of experts: also the active ones), flops per token (of the
active ones), memory per device by part at the config's microbatch (on the pipeline rank that
needs the most), the largest microbatch that fits the device memory (default: the detected
GPU's), the bytes each device sends per step, the pipeline bubble and the step time at a given
MFU of the device's peak (llmfoundry/planning.py says what each number counts and where its
formula comes from). `--recommend` plans the smallest mesh that fits instead (fewest tp x cp x
pp, then the fastest, then the least traffic, ep searched for an MoE; tp within a node), at
`--world-size` or at the fewest devices. Impossible inputs (tp not dividing the heads, more
stages than layers, a sequence cp cannot cut, axes whose product is not the device count, an ep
on a model without experts) are one line and exit status 2 (`--debug` for the traceback). A
setup in which not even one sequence fits a device, or in which no mesh fits, is an error (exit
status 2) saying what would fit, with no step time.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hydra.errors import HydraException
from hydra.utils import instantiate

from llmfoundry.callbacks.peak_flops import gpu_has_bf16, gpu_peak_flops, number_format
from llmfoundry.config import validate_config
from llmfoundry.config.parallelism import parallelism_of, strategy_name
from llmfoundry.config.preflight import check, compose_config
from llmfoundry.planning import (
    SCHEDULES,
    STRATEGIES,
    MeshChoice,
    Setup,
    bubble_fraction,
    largest_microbatch,
    optimizer_state_bytes,
    parse_bytes,
    plan_communication,
    plan_memory,
    planned_precision,
    recommend,
    smallest_fit,
    step_seconds,
)
from llmfoundry.utils.cli import add_script_arguments, script_errors
from llmfoundry.utils.errors import UserError

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("overrides", nargs="*", help="config overrides, as for scripts/train.py")
    p.add_argument("--strategy", choices=STRATEGIES, help="default: the config's strategy= "
                   "(single; fsdp with --recommend)")  # fmt: skip
    p.add_argument("--world-size", type=int, help="devices in the run (default 1; --recommend: "
                   "the fewest that fit)")  # fmt: skip
    p.add_argument("--gpus-per-node", type=int, default=8, help="for --recommend (tp stays "
                   "within a node; default 8)")  # fmt: skip
    # The mesh flags default to the config's parallelism block (`_mesh_from_config`).
    p.add_argument("--tp", type=int, help="tensor-parallel ways (default parallelism.tp)")
    p.add_argument("--pp", type=int, help="pipeline stages (default parallelism.pp)")
    p.add_argument("--cp", type=int, help="context-parallel ways: each sequence split over them "
                   "(default parallelism.cp)")  # fmt: skip
    p.add_argument("--ep", type=int, help="expert-parallel ways (MoE): each expert on one of ep "
                   "data-parallel ranks (default parallelism.ep)")  # fmt: skip
    p.add_argument("--dp-replicate", type=int, help="fsdp: replicas of the shards (hybrid "
                   "sharding; kept by --recommend; default parallelism.dp_replicate)")  # fmt: skip
    p.add_argument("--dp-shard", type=int, help="fsdp: shards (default parallelism.dp_shard, "
                   "-1: the rest)")  # fmt: skip
    p.add_argument("--schedule", choices=SCHEDULES, help="pipeline schedule (default "
                   "parallelism.pp_schedule)")  # fmt: skip
    p.add_argument("--stages-per-rank", type=int, default=1, help="interleaved: stages per rank")
    p.add_argument("--recommend", action="store_true", help="plan the smallest mesh that fits "
                   "--device-memory (fewest tp x cp x pp, then fastest) at --world-size, or at "
                   "the fewest devices that fit")  # fmt: skip
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--cpu-offload", action="store_true", help="optimizer (and shards) on host")
    p.add_argument("--device-memory", help="per device, e.g. 80GB (default: the detected GPU)")
    p.add_argument("--device-name", help="GPU name for its peak, e.g. H100 (default: detected)")
    p.add_argument("--peak-tflops", type=float, help="peak TFLOP/s per device (overrides name)")
    p.add_argument("--mfu", type=float, default=0.4, help="MFU for the step time (default 0.4)")
    p.add_argument("--microbatch", type=int, help="default: the config's microbatch, else 1 "
                   "under pp (the least bubble), else the device batch")  # fmt: skip
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
    if args.strategy in ("single", "ddp", "deepspeed_zero1", "deepspeed_zero2"):
        options.append("shard the weights (--strategy fsdp or deepspeed_zero3) over more devices")
    elif args.recommend:
        options.append(
            "more devices" + (f" than --world-size {args.world_size}" * bool(args.world_size))
        )
    else:
        options.append(f"more devices than --world-size {args.world_size}")
        if args.tp == args.pp == args.cp == 1:
            options.append("--recommend (a mesh with tp, cp and pp)")
    if not args.activation_checkpointing:
        options.append("--activation-checkpointing")
    if not args.cpu_offload and args.strategy not in ("single", "ddp"):
        options.append("--cpu-offload")
    options.append("a shorter max_seq_len or larger devices")
    return "try " + ", ".join(options)


# The mesh flags, by the parallelism block's key, and the block's defaults (conf/train.yaml).
_MESH_FLAGS = {"tp": "tp", "cp": "cp", "pp": "pp", "ep": "ep", "dp_replicate": "dp_replicate",
               "dp_shard": "dp_shard", "pp_schedule": "schedule"}  # fmt: skip
_MESH_DEFAULTS = {"tp": 1, "cp": 1, "pp": 1, "ep": 1, "dp_replicate": 1, "dp_shard": -1,
                  "pp_schedule": "1f1b"}  # fmt: skip


def _mesh_from_config(args: argparse.Namespace, block: dict) -> None:
    """Fill the mesh flags left out from the config's `parallelism:` block (read as
    scripts/train.py reads it, its old strategy.* aliases moved in), so a mesh set in the
    config is the one planned; a flag that contradicts a value the block sets is refused."""
    for key, flag in _MESH_FLAGS.items():
        given, configured = getattr(args, flag), block.get(key, _MESH_DEFAULTS[key])
        if given is None:
            setattr(args, flag, configured)
        elif configured != _MESH_DEFAULTS[key] and given != configured:
            option = "--" + flag.replace("_", "-")
            raise UserError(
                f"{option} {given} and parallelism.{key}={configured} disagree: give one of them"
            )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with script_errors(args):
        return plan(args)


def _setup(
    args: argparse.Namespace, cfg, settings, model_cfg, seq_len: int, precision: str
) -> Setup:
    return Setup(
        model=model_cfg,
        seq_len=seq_len,
        precision=precision,
        strategy=args.strategy,
        world_size=args.world_size or 1,
        gpus_per_node=args.gpus_per_node,
        activation_checkpointing=args.activation_checkpointing,
        cpu_offload=args.cpu_offload,
        optimizer_bytes=optimizer_state_bytes(cfg.optimizer._target_),
        tp=args.tp,
        pp=args.pp,
        cp=args.cp,
        ep=args.ep,
        schedule=args.schedule,
        stages_per_rank=args.stages_per_rank,
        dp_replicate=args.dp_replicate,
        dp_shard=args.dp_shard,
        global_batch=settings.global_train_batch_size,
    )


def _recommended(args: argparse.Namespace, setup: Setup, memory: float | None) -> MeshChoice:
    """The recommended mesh, or the UserError saying why there is none."""
    if memory is None:
        raise UserError("--recommend needs the device memory: pass --device-memory 80GB")
    if args.tp != 1 or args.pp != 1 or args.cp != 1 or args.ep != 1 or args.dp_shard != -1:
        raise UserError(
            "--recommend chooses tp, cp, pp, ep and dp_shard: leave those flags (and the "
            "config's parallelism.tp, cp, pp, ep and dp_shard) out"
        )
    if args.world_size:
        choice = recommend(setup, memory)
        where = f"{args.world_size} devices"
    else:
        choice = smallest_fit(setup, memory)
        where = "up to 16384 devices"
    if choice is None:
        size = args.device_memory
        raise UserError(
            f"no mesh of {where} fits {size} per device with global_train_batch_size="
            f"{setup.global_batch} (each data-parallel rank needs a whole sequence); "
            f"{_what_would_fit(args)}"
        )
    return choice


def plan(args: argparse.Namespace) -> int:
    try:
        cfg = compose_config(CONF_DIR, args.overrides)
    except HydraException:
        check(CONF_DIR, args.overrides)  # raises the ConfigError naming the key and the fix
        raise
    settings = validate_config(cfg)
    _mesh_from_config(args, parallelism_of(cfg))
    model_cfg = instantiate(cfg.model)
    seq_len = settings.max_seq_len or model_cfg.max_seq_len
    # The config's strategy (single unless given), fsdp for --recommend in place of single.
    configured = strategy_name(cfg) or "single"
    recommended = "fsdp" if args.recommend and configured == "single" else configured
    args.strategy = args.strategy or recommended
    if not args.recommend:
        args.world_size = args.world_size or 1
    gpu_name, gpu_memory = detected_gpu()
    name = args.device_name or gpu_name
    # With no GPU named or found, a current one (bf16 tensor cores) is planned for.
    precision = planned_precision(settings.precision, name is None or gpu_has_bf16(name))
    setup = _setup(args, cfg, settings, model_cfg, seq_len, precision)
    memory = parse_bytes(args.device_memory) if args.device_memory else gpu_memory
    configured = settings.device_train_microbatch_size
    microbatch = args.microbatch or (configured if isinstance(configured, int) else None)
    if args.recommend:
        choice = _recommended(args, setup, memory)
        setup, microbatch = choice.setup, microbatch or choice.microbatch
        args.world_size = setup.world_size
        dims = setup.dims
        ep = f" x ep {dims.ep}" * setup.counts.moe
        print(f"recommended : tp {dims.tp} x cp {dims.cp} x pp {dims.pp}{ep} x dp_shard "
              f"{dims.dp_shard} x dp_replicate {dims.dp_replicate} on {setup.world_size} devices "
              f"(fewest tp x cp x pp that fit, then the fastest, then the least traffic; tp <= "
              f"{setup.gpus_per_node}, within a node)")  # fmt: skip
    if settings.global_train_batch_size % setup.dp_size:
        raise UserError(
            f"global_train_batch_size={settings.global_train_batch_size} is not divisible by "
            f"the {setup.dp_size} data-parallel ranks (world size / (tp x cp x pp))"
        )
    device_batch = settings.global_train_batch_size // setup.dp_size
    microbatch = microbatch or (1 if setup.pp > 1 else device_batch)
    memory_plan = plan_memory(setup, microbatch)
    dims = setup.dims

    flags = [args.strategy, f"world size {setup.world_size}"]
    flags += ["activation checkpointing"] * args.activation_checkpointing
    flags += ["CPU offload"] * args.cpu_offload
    print(f"model       : {cfg.model._target_.rsplit('.', 1)[-1]} d_model {model_cfg.d_model}, "
          f"{model_cfg.n_layers} layers, vocab {model_cfg.vocab_size}, seq {seq_len}")  # fmt: skip
    print(f"run         : {', '.join(flags)}; {precision}; global batch "
          f"{settings.global_train_batch_size} ({device_batch} per data-parallel rank)"
          )  # fmt: skip
    moe = setup.counts.moe
    ep = f" (ep {dims.ep}: experts over ep x {dims.efsdp} FSDP ranks)" * moe
    print(f"mesh        : dp_replicate {dims.dp_replicate} x dp_shard {dims.dp_shard} x cp "
          f"{dims.cp} x tp {dims.tp} x pp {dims.pp}{ep}")  # fmt: skip
    active = f" ({memory_plan.active_params:,} active per token)" * moe
    print(f"parameters  : {memory_plan.n_params:,}{active}")
    n = "N active" if moe else "N"
    print(
        f"flops/token : {memory_plan.flops_per_token / 1e9:.3f} GFLOP (6{n} + 12 L d s, fwd + bwd)"
    )
    where = f", pipeline rank {memory_plan.stage} of {setup.pp}" if setup.pp > 1 else ""
    print(f"memory per device at microbatch {microbatch}{where}:")
    parts = ("params", "grads", "optimizer", "working", "activations", "logits", "attn_bias")
    for part in (*parts, "gathered_kv"):
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
        if memory_plan.total > memory:
            print(f"note        : microbatch {microbatch} does not fit; the rest is planned at "
                  f"it: pass --microbatch {fits} (device_train_microbatch_size={fits})"
                  )  # fmt: skip
    communication = plan_communication(setup, microbatch)
    print("communication per device per step (sent):")
    for part, label in (("all_gather", "all-gather"), ("reduce_scatter", "reduce-scatter"),
                        ("all_reduce", "all-reduce"), ("tensor_parallel", "tp gath+scat"),
                        ("context_parallel", "cp kv gathers"), ("pipeline", "pp sends"),
                        ("expert_parallel", "ep all-to-all")):  # fmt: skip
        if part != "expert_parallel" or moe:
            print(f"  {label:14s}: {gib(getattr(communication, part))}")
    print(f"  {'total':14s}: {gib(communication.total)}")
    microbatches = setup.microbatches(microbatch)
    bubble = bubble_fraction(setup.pp, microbatches, setup.schedule, setup.stages_per_rank)
    if setup.pp > 1:
        v = f", {setup.stages_per_rank} stages per rank" * (setup.schedule == "interleaved")
        print(f"pipeline    : {setup.schedule}{v}, {microbatches} microbatches of {microbatch}, "
              f"bubble {bubble:.1%} of the step")  # fmt: skip
    peak = args.peak_tflops * 1e12 if args.peak_tflops else None
    if peak is None and name:
        peak = gpu_peak_flops(name, number_format(precision))
    if peak is None:
        print("step time   : unknown peak; pass --device-name H100 or --peak-tflops 989")
    else:
        seconds = step_seconds(
            memory_plan.flops_per_token,
            settings.global_train_batch_size,
            seq_len,
            setup.world_size,
            peak,
            args.mfu,
            bubble,
        )
        tokens = settings.global_train_batch_size * seq_len / seconds
        idle = f", {bubble:.1%} pipeline bubble" if setup.pp > 1 else ""
        print(f"step time   : {seconds:.3f} s at {args.mfu:.0%} MFU of {peak / 1e12:.1f} TFLOP/s"
              f"{idle} ({tokens:,.0f} tokens/s in all)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

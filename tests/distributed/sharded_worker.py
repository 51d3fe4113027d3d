"""Bodies of the two-process FSDP tests (spawned children import them by module path).

One spawn runs several trainings in a row (a fresh process group each), since starting two
processes costs more than training the tiny model.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from unittest import mock

import torch
from torch.distributed.tensor import DTensor

from llmfoundry.callbacks import CheckpointSaver
from llmfoundry.checkpoint.state import model_state_dict
from llmfoundry.data import StreamingTextDataset
from llmfoundry.data.streaming import StreamingDataLoader
from llmfoundry.distributed import DDP, FSDP, SingleDevice, Strategy, unwrap_model
from llmfoundry.models.llama import LlamaConfig, LlamaForCausalLM
from llmfoundry.optim import DecoupledAdamW
from llmfoundry.trainer import Algorithm, Callback, Event, Trainer
from tests.checkpoint.helpers import SEQ_LEN, VOCAB, sample_ids
from tests.trainer.conftest import tiny_model, token_batches

from .spawn import join_env
from .workers import global_batches, rank_slice

# The parity runs: name -> FSDP options (None: DDP).
PARITY = {
    "ddp": None,
    "fsdp": {},
    "fsdp_hybrid": {"parallelism": {"dp_replicate": 2}},
    "fsdp_activation_checkpointing": {"activation_checkpointing": "full"},
    "fsdp_selective_activation_checkpointing": {"activation_checkpointing": "selective"},
    "fsdp_every_2nd_block_no_reshard": {
        "activation_checkpointing": 2,
        "reshard_after_forward": False,
    },
    "fsdp_cpu_offload": {"cpu_offload": True},
}
RESUME_BATCHES, STOP_AT, GLOBAL_BATCH = 4, 2, 4
DIVERGE_AT = 3  # the batch after which the diverged runs' weights are NaN (saves: every batch)


class Recorder(Callback):
    """Each step's loss and this rank's sample ids; the whole initial weights (rank 0); the
    eval metrics at the end."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.ids: list[list[int]] = []
        self.initial: dict[str, torch.Tensor] = {}
        self.eval_metrics: dict[str, float] = {}

    def fit_start(self, state, logger) -> None:
        if state.timestamp.batch == 0:  # a collective under FSDP: every rank asks
            weights = model_state_dict(state.model)  # live tensors unsharded
            self.initial = {name: tensor.clone() for name, tensor in weights.items()}

    def after_dataloader(self, state, logger) -> None:
        self.ids.append(sample_ids(state.batch))

    def batch_end(self, state, logger) -> None:
        self.losses.append(state.train_loss)

    def fit_end(self, state, logger) -> None:
        self.eval_metrics = dict(state.eval_metrics)


class SigtermAt(Callback):
    """Rank 1 gets SIGTERM (as from a scheduler preempting the job) as batch `batch` starts.

    The ranks agree on it in that batch's count all-reduce (`Trainer._global_counts`), so both
    stop after it; a signal arriving later in the batch would stop them after the next one.
    """

    def __init__(self, batch: int) -> None:
        self.batch = batch

    def batch_start(self, state, logger) -> None:
        if state.rank == 1 and state.timestamp.batch == self.batch - 1:
            os.kill(os.getpid(), signal.SIGTERM)


class StopAt(Callback):
    def __init__(self, batch: int) -> None:
        self.batch = batch

    def batch_end(self, state, logger) -> None:
        state.stop_training = state.stop_training or state.timestamp.batch == self.batch


class Diverge(Callback):
    """At the end of batch `at` the first weight turns NaN (training diverged), on rank `rank`
    only (its part of it: an FSDP shard, a ZeRO-3 partition) or on every rank (None: DDP
    replicas diverge together)."""

    def __init__(self, at: int, rank: int | None) -> None:
        self.at, self.rank = at, rank

    def batch_end(self, state, logger) -> None:
        if state.timestamp.batch == self.at and self.rank in (None, state.rank):
            weight = next(unwrap_model(state.model).parameters())
            with torch.no_grad():
                local = (
                    weight.to_local()
                    if isinstance(weight, DTensor)
                    else getattr(weight, "ds_tensor", weight)  # ZeRO-3: this rank's partition
                )
                local.fill_(float("nan"))


class OutOfMemoryInBlock(Algorithm):
    """On one rank, a block runs out of memory for microbatches larger than `limit`:
    ``"forward"`` in the second block's forward (after the first blocks' all-gathers, while the
    other rank goes on gathering), ``"backward"`` as the first block's backward starts (after
    the second block's reduce-scatter, while the other rank heads for the first block's)."""

    def __init__(self, rank: int, limit: int, where: str) -> None:
        self.rank, self.limit, self.where, self.raised = rank, limit, where, 0
        self._size = 0

    def match(self, event, state):
        return event in (Event.FIT_START, Event.BEFORE_FORWARD) and state.rank == self.rank

    def apply(self, event, state, logger):
        if event is Event.BEFORE_FORWARD:
            self._size = state.batch["input_ids"].shape[0]
        elif self.where == "forward":
            state.model.transformer.blocks[1].register_forward_hook(self._raise)
        else:
            state.model.transformer.blocks[0].register_full_backward_pre_hook(self._raise)

    def _raise(self, *_):
        if self._size > self.limit:
            self.raised += 1
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")


def parity_run(
    strategy: Strategy,
    rank: int,
    world: int,
    callbacks: tuple[Callback, ...] = (),
    model: torch.nn.Module | None = None,
    **kwargs,
) -> Recorder:
    """Three AdamW steps of `model` (default: the tiny MPT) on the shared global batches (this
    rank's slice of each); `callbacks` are added to the recorder."""
    batches = global_batches()
    recorder = Recorder()
    Trainer(
        model=tiny_model() if model is None else model,
        strategy=strategy,
        train_dataloader=rank_slice(batches, rank, world),
        max_duration=f"{len(batches)}ba",
        optimizer=functools.partial(DecoupledAdamW, lr=1e-2, weight_decay=1e-2),
        callbacks=[recorder, *callbacks],
        run_dir=os.environ.get("TMPDIR", "/tmp"),
        **kwargs,
    ).fit()
    return recorder


def resume_run(
    strategy: Strategy,
    mds: str,
    folder: str,
    stop_at: int | None = None,
    load: str | None = None,
    sigterm_at: int | None = None,
    load_ignore_keys: tuple[str, ...] = (),
    algorithms: tuple[Algorithm, ...] = (),
    callbacks: tuple[Callback, ...] = (),
    save_interval: str | None = None,
    keep: int = -1,
    family: str = "mpt",
    model: Callable[[], torch.nn.Module] | None = None,
    device_train_microbatch_size: int | None = None,
) -> Recorder:
    """Training on the real data pipeline, its partition taken from the strategy; stopped
    after batch `stop_at`, or by SIGTERM to rank 1 after batch `sigterm_at` (preemption);
    `algorithms` and `callbacks` are added; `keep` checkpoints are kept (-1: all); `family`
    "llama" trains a tiny Llama (GQA, untied head) instead of the tiny MPT; `model` builds another."""
    recorder = Recorder()
    dataset = StreamingTextDataset(
        mds, split="train", shuffle=True, shuffle_seed=5, shuffle_block_size=8,
        batch_size=GLOBAL_BATCH // strategy.dp_size, max_seq_len=SEQ_LEN,
        data_parallel=(strategy.dp_rank, strategy.dp_size),
    )  # fmt: skip
    loader = StreamingDataLoader(dataset)
    Trainer(
        model=model() if model else tiny_model(VOCAB, SEQ_LEN) if family == "mpt" else tiny_llama(),
        strategy=strategy,
        train_dataloader=loader,
        max_duration=f"{RESUME_BATCHES}ba",
        optimizer=functools.partial(DecoupledAdamW, lr=3e-3, weight_decay=1e-2),
        callbacks=[
            recorder,
            *([StopAt(stop_at)] if stop_at else []),
            *([SigtermAt(sigterm_at)] if sigterm_at else []),
            CheckpointSaver(folder, save_interval, num_checkpoints_to_keep=keep),
            *callbacks,
        ],
        algorithms=list(algorithms),
        run_dir=folder,
        load_path=load,
        load_ignore_keys=load_ignore_keys,
        device_train_microbatch_size=device_train_microbatch_size,
    ).fit()
    return recorder


def tiny_llama() -> LlamaForCausalLM:
    """On meta, as `tiny_model`: the Trainer initializes it after seeding."""
    config = LlamaConfig(
        d_model=32, n_heads=2, n_kv_heads=1, n_layers=2, vocab_size=VOCAB, max_seq_len=SEQ_LEN,
        init_device="meta",
    )  # fmt: skip
    return LlamaForCausalLM(config)


def diverged_run(strategy: Strategy, mds: str, folder: str, poisoned: int | None) -> str:
    """`resume_run` saving every batch, keeping 2, whose weights turn NaN after batch
    `DIVERGE_AT` on rank `poisoned` (None: every rank); returns the error the rank ended with
    ("" if none)."""
    try:
        resume_run(
            strategy, mds, folder, save_interval="1ba", keep=2,
            callbacks=(Diverge(DIVERGE_AT, poisoned),),
        )  # fmt: skip
    except Exception as err:  # noqa: BLE001 - whatever each rank ended with is the result
        return f"{type(err).__name__}: {err}"
    return ""


def rank_main(rank: int, world: int, ports: list[int], out: str, mds: str) -> None:
    ports = iter(ports)
    result: dict[str, dict] = {}

    def record(name: str, recorder: Recorder, **extra) -> None:
        result[name] = {"losses": recorder.losses, "ids": recorder.ids, **extra}

    for name, options in PARITY.items():
        join_env(rank, world, next(ports))
        strategy = (
            DDP("cpu", timeout_s=60) if options is None else FSDP("cpu", timeout_s=60, **options)
        )
        recorder = parity_run(strategy, rank, world)
        record(name, recorder, initial=recorder.initial)

    for where in ("forward", "backward"):
        join_env(rank, world, next(ports))
        oom = OutOfMemoryInBlock(rank=1, limit=1, where=where)
        recorder = parity_run(
            FSDP("cpu", timeout_s=60), rank, world, device_train_microbatch_size="auto",
            algorithms=[oom],
        )  # fmt: skip
        record(f"fsdp_auto_oom_in_{where}", recorder, raised=oom.raised)

    join_env(rank, world, next(ports))
    record("fsdp_bf16", parity_run(FSDP("cpu", timeout_s=60, mixed_precision="bf16"), rank, world))

    for name, make, kwargs in (
        ("fsdp_straight", FSDP, {}),
        ("fsdp_saved", FSDP, {"stop_at": STOP_AT}),
        ("ddp_from_fsdp", DDP, {"load": f"{out}/fsdp_saved"}),
        ("ddp_saved", DDP, {"stop_at": STOP_AT}),
        ("fsdp_from_ddp", FSDP, {"load": f"{out}/ddp_saved"}),
        ("fsdp_from_single", FSDP, {"load": f"{out}/single_saved"}),
        ("fsdp_preempted", FSDP, {"sigterm_at": STOP_AT}),
        ("fsdp_after_preemption", FSDP, {"load": f"{out}/fsdp_preempted"}),
        # The Llama family through the same strategies (its plan shards its blocks).
        ("llama_fsdp_straight", FSDP, {"family": "llama"}),
        ("llama_fsdp_saved", FSDP, {"family": "llama", "stop_at": STOP_AT}),
        ("llama_ddp_from_fsdp", DDP, {"family": "llama", "load": f"{out}/llama_fsdp_saved"}),
    ):
        join_env(rank, world, next(ports))
        folder = f"{out}/{name}"
        record(name, resume_run(make("cpu", timeout_s=60), mds, folder, **kwargs))
    torch.save(result, Path(out) / f"rank{rank}.pt")


def real_oom_rank(rank: int, world: int, port: int, out: str) -> None:
    """FSDP on the GPU (nccl), its memory capped 1 GiB above what it holds, with a batch whose
    activations cannot fit (as tests/trainer/test_auto_microbatching.py's real out-of-memory
    test): auto-microbatching resets FSDP's state after each real error and halves until a
    step fits. Saves the microbatch size it settled on."""
    join_env(rank, world, port)
    torch.cuda.set_device(rank)
    torch.cuda.empty_cache()
    _, total = torch.cuda.mem_get_info()
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_allocated() + 2**30) / total)
    state = Trainer(
        model=tiny_model(vocab_size=50000, seq_len=256),
        strategy=FSDP("cuda", timeout_s=120),
        train_dataloader=token_batches(2, 512, seq_len=256, vocab=50000),
        max_duration="2ba",
        optimizer=functools.partial(torch.optim.SGD, lr=0.1),
        run_dir=out,
        device_train_microbatch_size="auto",
    ).fit()
    size = torch.tensor(state.device_train_microbatch_size)
    torch.save({"microbatch": size}, Path(out) / f"rank{rank}.pt")


def single_resume_run(mds: str, folder: str, **kwargs) -> Recorder:
    return resume_run(SingleDevice("cpu"), mds, folder, **kwargs)


def forge_deepspeed_payload(saved: str, forged: str, marker: str) -> None:
    """Copy the save folder `saved` to `forged`, a payload that creates `marker` added to each
    DeepSpeed file of its checkpoint, the manifest recomputed."""
    from llmfoundry.checkpoint import latest_checkpoint
    from llmfoundry.checkpoint.manifest import MANIFEST, hash_tree, manifest_bytes
    from tests.checkpoint.test_dcp_payloads import Payload

    shutil.copytree(saved, forged)
    checkpoint = Path(latest_checkpoint(forged))
    for path in (checkpoint / "sharded").rglob("*.pt"):
        state = torch.load(path, weights_only=False)  # the author's own files
        state["payload"] = Payload(marker)
        torch.save(state, path)
    (checkpoint / MANIFEST).unlink()
    (checkpoint / MANIFEST).write_bytes(manifest_bytes(hash_tree(checkpoint)))


def _cut_in_half(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


# How the DeepSpeed checkpoint copies are damaged: name -> (file of its sharded/ folder, what is
# done to it, whether before the manifest was written, so that it vouches for the damage).
DEEPSPEED_DAMAGE: dict[str, tuple[str, Callable[[Path], None], bool]] = {
    "cut": ("zero_pp_rank_1_mp_rank_00_optim_states.pt", _cut_in_half, True),
    "junk": (
        "zero_pp_rank_0_mp_rank_00_model_states.pt",
        lambda p: p.write_bytes(b"junk" * 9),
        True,
    ),
    "lost": ("zero_pp_rank_1_mp_rank_00_model_states.pt", Path.unlink, True),
    "flipped": ("zero_pp_rank_1_mp_rank_00_optim_states.pt", _flip_a_byte, False),
}


def damage_deepspeed_copy(saved: str, damaged: str, name: str) -> None:
    """Copy the save folder `saved` to `damaged`, one DeepSpeed file of its checkpoint damaged
    as `DEEPSPEED_DAMAGE[name]` says."""
    from llmfoundry.checkpoint import latest_checkpoint
    from llmfoundry.checkpoint.manifest import MANIFEST, hash_tree, manifest_bytes

    shutil.copytree(saved, damaged)
    checkpoint = Path(latest_checkpoint(damaged))
    file, damage, before_manifest = DEEPSPEED_DAMAGE[name]
    damage(checkpoint / "sharded" / file)
    if before_manifest:
        (checkpoint / MANIFEST).unlink()
        (checkpoint / MANIFEST).write_bytes(manifest_bytes(hash_tree(checkpoint)))


class LinearDtypes(Callback):
    """The dtypes of the first block's fused qkv projection, as seen inside the model: its
    weight, and its output (the autocast dtype, when autocast reaches inside the engine)."""

    def __init__(self) -> None:
        self.outputs: set[str] = set()
        self.weights: set[str] = set()

    def fit_start(self, state, logger) -> None:
        unwrap_model(state.model).transformer.blocks[0].attn.Wqkv.register_forward_hook(self._seen)

    def _seen(self, module, args, output) -> None:
        self.weights.add(str(module.weight.dtype))
        self.outputs.add(str(output.dtype))


@contextlib.contextmanager
def fp16_on_cpu() -> Iterator[None]:
    """amp_fp16 on this CPU: the product refuses it there (fp16 matmuls take torch's slow
    fallback, affordable for the tiny model), and so does DeepSpeed's CPU accelerator without
    native fp16 (AVX512-FP16/AMX-FP16)."""
    from deepspeed.accelerator import get_accelerator

    from llmfoundry.core import precision

    with (
        mock.patch.object(precision, "FP16_DEVICE_TYPES", ("cuda", "cpu")),
        mock.patch.object(type(get_accelerator()), "is_fp16_supported", lambda self: True),
    ):
        yield


@contextlib.contextmanager
def autocast_seen_as_on_cuda() -> Iterator[None]:
    """DeepSpeed asks ``torch.is_autocast_enabled()`` without a device, which is CUDA's: on a GPU
    it sees the trainer's autocast (and, without its own torch_autocast section, turns it off
    inside the engine); on CPU it sees none. Here it gets the CPU's answer, as on a GPU."""
    original = torch.is_autocast_enabled

    def is_autocast_enabled(*args, **kwargs) -> bool:
        return original(*args, **kwargs) if args or kwargs else original("cpu")

    with mock.patch.object(torch, "is_autocast_enabled", is_autocast_enabled):
        yield


def deepspeed_precision_run(rank: int, world: int, stage: int, precision: str) -> dict:
    """A parity run of ZeRO `stage` in `precision`: its losses, what the model computed in, the
    loss scale DeepSpeed ended at and the trainer's own scaler state, or the error it ended with."""
    from llmfoundry.distributed import DeepSpeed

    dtypes, scaler = LinearDtypes(), {}

    class Scales(Callback):
        def fit_end(self, state, logger) -> None:
            scaler["deepspeed"] = float(state.strategy.engine.optimizer.loss_scale)
            scaler["trainer"] = state.precision.state_dict()

    fp16 = fp16_on_cpu() if precision == "amp_fp16" else contextlib.nullcontext()
    try:
        with autocast_seen_as_on_cuda(), fp16:
            recorder = parity_run(
                DeepSpeed(stage, "cpu", timeout_s=60), rank, world, callbacks=(dtypes, Scales()),
                device_train_microbatch_size=1, precision=precision,
            )  # fmt: skip
    except Exception as err:  # noqa: BLE001 - what each rank ended with is the result
        return {"error": f"{type(err).__name__}: {err}"}
    return {
        "error": "", "losses": recorder.losses, "outputs": sorted(dtypes.outputs),
        "weights": sorted(dtypes.weights), "scales": scaler,
    }  # fmt: skip


def deepspeed_rank_main(rank: int, world: int, ports: list[int], out: str, mds: str) -> None:
    """ZeRO 1-3 on the parity batches (two microbatches per rank: DeepSpeed must respect the
    trainer's accumulation boundary), in amp_bf16 and amp_fp16 too (`deepspeed_precision_run`),
    then a ZeRO-3 run stopped, saved and resumed, one started from a one-process checkpoint's
    weights, and one that diverges (`diverged_run`)."""
    import deepspeed

    from llmfoundry.distributed import DeepSpeed

    # DeepSpeed caches its process groups for the life of the process, so all runs share one
    # (each strategy finds it initialized and leaves it); `owner` creates and destroys it.
    join_env(rank, world, ports[0])
    owner = DDP("cpu", timeout_s=60)
    owner.setup()
    result: dict[str, dict] = {}
    for stage in (1, 2, 3):
        recorder = parity_run(
            DeepSpeed(stage, "cpu", timeout_s=60), rank, world, device_train_microbatch_size=1
        )
        result[f"zero{stage}"] = {"losses": recorder.losses}
    for stage, precision in ((2, "amp_bf16"), (3, "amp_bf16"), (2, "amp_fp16"), (3, "amp_fp16")):
        result[f"zero{stage}_{precision}"] = deepspeed_precision_run(rank, world, stage, precision)
    for name, kwargs in (
        ("zero3_straight", {}),
        ("zero3_saved", {"stop_at": STOP_AT}),
        ("zero3_resumed", {"load": f"{out}/zero3_saved"}),
        # A full (safetensors) checkpoint's weights into ZeRO-3's partitioned parameters.
        ("zero3_from_single", {"load": f"{out}/single_saved", "load_ignore_keys": ("optimizer",)}),
    ):
        recorder = resume_run(DeepSpeed(3, "cpu", timeout_s=60), mds, f"{out}/{name}", **kwargs)
        result[name] = {"losses": recorder.losses, "ids": recorder.ids}
    # A copy of the ZeRO-3 checkpoint with a payload pickled into every DeepSpeed file (and its
    # manifest recomputed, as its author would): refused by both ranks, the payload never runs.
    forged = f"{out}/zero3_forged"
    if rank == 0:
        forge_deepspeed_payload(f"{out}/zero3_saved", forged, f"{out}/payload-ran")
    torch.distributed.barrier()
    try:
        resume_run(DeepSpeed(3, "cpu", timeout_s=60), mds, f"{out}/zero3_refused", load=forged)
        result["zero3_forged"] = {"error": ""}
    except Exception as err:  # noqa: BLE001 - what each rank ended with is the result
        result["zero3_forged"] = {"error": f"{type(err).__name__}: {err}"}
    # Damaged copies: refused by both ranks before DeepSpeed reads a file (else the rank whose
    # file failed raised while the other waited in a collective until timeout_s).
    for damage in DEEPSPEED_DAMAGE:
        damaged = f"{out}/zero3_{damage}"
        if rank == 0:
            damage_deepspeed_copy(f"{out}/zero3_saved", damaged, damage)
        torch.distributed.barrier()
        try:
            resume_run(DeepSpeed(3, "cpu", timeout_s=60), mds, f"{damaged}_run", load=damaged)
            result[f"zero3_{damage}"] = {"error": ""}
        except Exception as err:  # noqa: BLE001 - what each rank ended with is the result
            result[f"zero3_{damage}"] = {"error": f"{type(err).__name__}: {err}"}
    # Only rank 1's partition of a weight turns NaN: both ranks refuse the save.
    error = diverged_run(DeepSpeed(3, "cpu", timeout_s=60), mds, f"{out}/zero3_diverged", 1)
    result["zero3_diverged"] = {"error": error}
    # The shared-memory kernel DeepSpeed would JIT-compile (see DeepSpeed.wrap_optimizer).
    result["comm"] = {"shm_kernel": deepspeed.comm.comm.cdb.shm_comm_op is not None}
    owner.teardown()
    torch.save(result, Path(out) / f"rank{rank}.pt")

"""DeepSpeed ZeRO stages 1-3 over torchrun's processes (optional: ``pip install
'llmfoundry[deepspeed]'``).

ZeRO-1 partitions the optimizer state over the ranks, ZeRO-2 also the gradients, ZeRO-3 also the
parameters (gathered per layer for forward and backward). DeepSpeed owns backward, the optimizer
step and gradient accumulation boundaries, so those steps of `Strategy` are routed to its
engine; the optimizer is ours (its parameter groups, hyperparameters and our schedule, which
sets each group's lr before every step), and DeepSpeed's config is built from this strategy's
options rather than written by hand:

- micro batches and accumulation: the trainer splits each batch itself, weights each
  microbatch's loss by its share of the global batch's loss tokens, and marks the last
  microbatch as the accumulation boundary, so DeepSpeed neither rescales the loss nor counts
  micro steps (``gradient_accumulation_steps`` is 1 for it);
- precision (`PRECISION_CONFIG`): ``amp_bf16`` runs torch's autocast inside the engine over
  fp32 weights, as the trainer does for the other strategies (DeepSpeed 0.17.6+ disables an
  autocast entered outside its engine unless its ``torch_autocast`` section enables one), with
  gradients reduced in fp32 as FSDP's; ``amp_fp16`` is DeepSpeed's fp16 mode: fp16 weights,
  fp32 master copies in ZeRO's partitions and DeepSpeed's dynamic loss scaler (saved in its
  checkpoints), so the trainer's `Precision` scales nothing (`scales_loss`). Its autocast
  route for fp16 is not used: 0.19 clips loss-scaled gradients as if unscaled and, on
  overflow, never lowers the scale (every later step skipped);
- clipping: `gradient_clipping` (DeepSpeed clips its partitioned gradients; the
  gradient_clipping algorithm cannot see them, so do not combine the two);
- offload: `offload_optimizer` (stages 1-3) and `offload_params` (stage 3) to CPU memory.

Checkpoints: DeepSpeed's own (each rank's partitions in the checkpoint's ``sharded/`` folder)
plus our trainer state, read and written by llmfoundry/checkpoint/deepspeed.py through `engine`.
Auto-microbatching is refused: ZeRO reduces gradients inside backward, and DeepSpeed offers no
way to abandon that mid-step.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from llmfoundry.distributed.base import materialize
from llmfoundry.distributed.mesh import ParallelDims
from llmfoundry.distributed.parallelize import apply_plan
from llmfoundry.distributed.process_group import ProcessGroupStrategy
from llmfoundry.utils.errors import MissingPackage, UserError

INSTALL = "pip install 'llmfoundry[deepspeed]'"
# The first release whose `torch_autocast` section (0.17.2) uses no loss scaler for bf16 and
# gathers ZeRO-3 parameters in their own dtype (both fixed in 0.17.6).
MIN_VERSION = "0.17.6"
SHM_COMM_OP = "deepspeed_shm_comm"  # DeepSpeed's ShareMemCommBuilder.NAME
# The trainer's precision -> the sections of DeepSpeed's config that implement it (see the
# module docstring). An empty list of "lower precision safe" modules: none reduces its
# gradients in bf16 (DeepSpeed's default for Linear layers).
PRECISION_CONFIG: dict[str, dict[str, Any]] = {
    "fp32": {},
    "amp_bf16": {
        "torch_autocast": {"enabled": True, "dtype": "bfloat16", "lower_precision_safe_modules": []}
    },
    "amp_fp16": {"fp16": {"enabled": True}},
}


def _import_deepspeed() -> Any:
    try:
        import deepspeed
    except ImportError:
        raise MissingPackage(f"the deepspeed strategies need DeepSpeed: {INSTALL}") from None
    from packaging.version import Version  # a dependency of DeepSpeed's

    if Version(deepspeed.__version__) < Version(MIN_VERSION):
        raise MissingPackage(
            f"the deepspeed strategies need DeepSpeed {MIN_VERSION} or newer (its torch_autocast "
            f"section), found {deepspeed.__version__}: {INSTALL}"
        )
    return deepspeed


class DeepSpeed(ProcessGroupStrategy):
    """ZeRO `stage` 1, 2 or 3 through DeepSpeed's engine (see the module docstring), over the
    data-parallel axes of `parallelism` (mesh.py `parallel_dims`: no cp, tp or pp)."""

    sharded_checkpoints = True
    saves_own_checkpoints = True
    scales_loss = True

    def __init__(
        self,
        stage: int,
        device: str = "auto",
        backend: str | None = None,
        timeout_s: float = 1800.0,
        gradient_clipping: float | None = None,
        offload_optimizer: bool = False,
        offload_params: bool = False,
        parallelism: Mapping[str, Any] | ParallelDims | None = None,
    ) -> None:
        if stage not in (1, 2, 3):
            raise UserError(f"strategy.stage={stage!r}: DeepSpeed ZeRO stages are 1, 2 and 3")
        self.name = f"deepspeed_zero{stage}"
        super().__init__(device, backend, timeout_s, parallelism)
        if offload_params and stage != 3:
            raise UserError(
                f"strategy.offload_params needs ZeRO stage 3 (parameters are only partitioned "
                f"there), got stage {stage}; use strategy=deepspeed_zero3 or offload_optimizer"
            )
        if gradient_clipping is not None and gradient_clipping <= 0:
            raise UserError(f"strategy.gradient_clipping must be positive, got {gradient_clipping}")
        self.deepspeed = _import_deepspeed()
        self.stage = stage
        self.gradient_clipping = gradient_clipping
        self.offload_optimizer = offload_optimizer
        self.offload_params = offload_params
        self.engine: Any = None

    def deepspeed_config(self, precision: str) -> dict[str, Any]:
        """DeepSpeed's config, from this strategy's options and the trainer's `precision` (see
        the module docstring)."""
        zero: dict[str, Any] = {"stage": self.stage}
        if self.offload_optimizer:
            zero["offload_optimizer"] = {"device": "cpu"}
        if self.offload_params:
            zero["offload_param"] = {"device": "cpu"}
        config: dict[str, Any] = {
            # DeepSpeed checks micro x accumulation x ranks == batch; the trainer batches itself.
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "train_batch_size": self.world_size,
            "zero_optimization": zero,
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 2**62,
            "wall_clock_breakdown": False,
            # DeepSpeed clips at norm 1.0 unless told otherwise; 0 turns its clipping off.
            "gradient_clipping": self.gradient_clipping or 0.0,
            **PRECISION_CONFIG[precision],
        }
        return config

    def prepare(self, model: torch.nn.Module) -> torch.nn.Module:
        """Materialize with rank 0's generator on every rank (DeepSpeed partitions each rank's
        copy), so the weights equal one process's for the same seed."""
        apply_plan(model)
        with self.rank0_generator():
            return materialize(model, self.device)

    def wrap_optimizer(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, precision: str
    ) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        # On CPU, DeepSpeed's communication backend JIT-compiles a shared-memory all-reduce
        # kernel the first time it starts (230 s on a loaded 2-core machine), behind a lock file
        # that a killed build leaves behind, so every later start waits on it forever. Only its
        # inference all-reduce uses that kernel; training reduces through torch.distributed.
        # DeepSpeed's cached op table is its switch for an op: marked incompatible, not built.
        self.deepspeed.ops.__compatible_ops__[SHM_COMM_OP] = False
        self.engine, ds_optimizer, _, _ = self.deepspeed.initialize(
            model=model, optimizer=optimizer, config=self.deepspeed_config(precision)
        )
        return self.engine, ds_optimizer

    # ------------------------------------------------------------------ the training step
    def sync_context(self, model: torch.nn.Module, sync: bool) -> AbstractContextManager:
        self.engine.set_gradient_accumulation_boundary(sync)
        return nullcontext()

    def guard_collectives(self, model: torch.nn.Module, guard: bool = True) -> None:
        raise UserError(
            f"device_train_microbatch_size=auto is not supported with strategy={self.name}: "
            "ZeRO reduces gradients inside backward and cannot abandon a step; set an integer "
            "device_train_microbatch_size, or use strategy=fsdp"
        )

    def backward(self, loss: torch.Tensor, precision: Any) -> None:
        # The trainer already weighted the loss by the microbatch's share of the batch.
        self.engine.backward(loss, scale_wrt_gas=False)

    def step(self, optimizer: torch.optim.Optimizer, precision: Any) -> None:
        self.engine.step()

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        self.engine.zero_grad()

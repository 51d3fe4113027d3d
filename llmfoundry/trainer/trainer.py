"""The fit loop. It names its events and leaves every optional feature to algorithms and callbacks.

Reading order: `fit` (epochs and batches), `_train_batch` (microbatches, backward, optimizer
step), `evaluate` (each eval set). Where each event fires is listed in `llmfoundry/core/events.md`.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from llmfoundry.checkpoint import Preemption, load_checkpoint
from llmfoundry.core.engine import Algorithm, Callback, Engine, Logger, LoggerDestination
from llmfoundry.core.events import Event
from llmfoundry.core.metrics import SAMPLE_MASK, DeviceScalar, loss_token_count
from llmfoundry.core.model import (
    EvalSet,
    Metrics,
    eval_set,
    loss_fn,
    metrics_factory,
    train_metrics_fn,
)
from llmfoundry.core.precision import Precision
from llmfoundry.core.state import State
from llmfoundry.core.time import Time, TimeUnit
from llmfoundry.distributed import OutOfMemoryElsewhere, SingleDevice, Strategy
from llmfoundry.optim.param_groups import build_param_groups
from llmfoundry.rng import load_rng_state, rng_state, seed_all
from llmfoundry.utils.errors import UserError
from llmfoundry.utils.host_memory import reuse_freed_host_memory

log = logging.getLogger(__name__)

OptimizerFactory = Callable[[list[dict[str, Any]]], torch.optim.Optimizer]
Schedule = Callable[[State], float]
# Auto-microbatching: steps a microbatch size must fit before the strategy's guards against an
# out-of-memory error on one rank come off (`Strategy.guard_collectives`). The first step
# allocates the optimizer's state after its backward, so the second is the first to run
# forward and backward at the memory every later step needs.
SETTLE_STEPS = 2


class Trainer:
    """Trains `model` on batches of ``{"input_ids", "labels"}``: ``outputs = model(batch)``,
    then ``model.loss(outputs, batch)`` (the contract: `llmfoundry.core.model`).

    Each value of `eval_dataloaders` is a loader, scored by the model's metrics (default
    `LanguageMetrics`), or an `EvalSet` carrying its own.

    The model is handed over unprepared (typically built on the meta device); the strategy
    materializes and wraps it, and only then is the optimizer built from `optimizer`, a factory
    taking parameter groups (Hydra's ``_partial_: true``; groups from
    `llmfoundry.optim.build_param_groups`, so the optimizer config can exempt norms, biases and
    embeddings from weight decay), so sharded strategies can replace parameters before the
    optimizer sees them.

    `device_train_microbatch_size` is an int, None (the whole per-device batch; under pp the
    fewest microbatches that keep every stage busy: `Pipeline.default_microbatch_size`) or "auto":
    start from the whole per-device batch and halve on out-of-memory errors (`_train_batch`).
    `device_eval_microbatch_size`: rows per forward in evaluation (None: each eval batch whole);
    a forward's logits ([rows, seq, vocab]) are what evaluation holds, so this bounds its memory
    whatever size the eval loaders batch by.

    `scheduler` maps the state to a learning-rate multiplier of each group's initial lr.

    `precision`: "auto" (amp_bf16 on a GPU with bf16 tensor cores, else fp32:
    `llmfoundry.core.precision`), "fp32", "amp_bf16" or "amp_fp16".
    """

    def __init__(
        self,
        *,
        model: torch.nn.Module,
        train_dataloader: Iterable[dict[str, torch.Tensor]],
        max_duration: str | Time,
        optimizer: OptimizerFactory,
        run_dir: str | Path,
        scheduler: Schedule | None = None,
        strategy: Strategy | None = None,
        eval_dataloaders: Mapping[str, Iterable[dict[str, torch.Tensor]] | EvalSet] | None = None,
        eval_interval: str | Time | None = None,
        eval_first: bool = False,
        eval_subset_num_batches: int | None = None,
        algorithms: Sequence[Algorithm] = (),
        callbacks: Sequence[Callback] = (),
        loggers: Sequence[LoggerDestination] = (),
        precision: str = "auto",
        device_train_microbatch_size: int | str | None = None,
        device_eval_microbatch_size: int | None = None,
        seed: int = 17,
        config: dict[str, Any] | None = None,
        load_path: str | None = None,
        load_ignore_keys: Sequence[str] = (),
    ) -> None:
        self.strategy = strategy or SingleDevice()
        if self.strategy.pipeline is not None:
            _check_pipeline_options(precision, device_train_microbatch_size)
        self.strategy.setup()
        if self.strategy.device.type == "cpu":  # large tensors come and go every step
            reuse_freed_host_memory()
        seed_all(seed + self.strategy.rank)
        self.loss_fn = loss_fn(model)
        self.train_metrics = train_metrics_fn(model)
        self.default_metrics = metrics_factory(model)
        prepared = self.strategy.prepare(model)
        opt = optimizer(build_param_groups(prepared))
        for group in opt.param_groups:
            group.setdefault("initial_lr", group["lr"])
        self.precision = Precision(
            precision, self.strategy.device, grad_scaler=not self.strategy.scales_loss
        )
        prepared, opt = self.strategy.wrap_optimizer(prepared, opt, self.precision.name)
        self.schedule = scheduler
        self.auto_microbatching = _is_auto(device_train_microbatch_size)
        if device_eval_microbatch_size is not None and device_eval_microbatch_size < 1:
            raise UserError(
                f"device_eval_microbatch_size must be a positive integer (rows per eval "
                f"forward) or None (each eval batch whole), got {device_eval_microbatch_size}"
            )
        self.device_eval_microbatch_size = device_eval_microbatch_size
        if self.auto_microbatching:
            self.strategy.guard_collectives(prepared, guard=True)
        self._logged_microbatch_size: int | None = None
        self._steps_at_size = 0  # steps the auto microbatch size has fit (`SETTLE_STEPS`)
        self.eval_interval = Time.parse(eval_interval) if eval_interval else None
        self.eval_first = eval_first
        self.eval_subset_num_batches = eval_subset_num_batches
        self._subset_noted: set[str] = set()  # eval sets whose subset was said in the log
        self._last_eval_batch = -1
        self.state = State(
            model=prepared,
            optimizer=opt,
            scheduler=scheduler,
            max_duration=Time.parse(max_duration),
            run_dir=Path(run_dir),
            device=self.strategy.device,
            precision=self.precision,
            rank=self.strategy.rank,
            world_size=self.strategy.world_size,
            dp_size=self.strategy.dp_size,
            seed=seed,
            train_dataloader=train_dataloader,
            eval_dataloaders=dict(eval_dataloaders or {}),
            dataloader_len=_length(train_dataloader),
            device_train_microbatch_size=(
                None if self.auto_microbatching else device_train_microbatch_size
            ),
            config=config or {},
            strategy=self.strategy,
        )
        self.logger = Logger(self.state, loggers)
        self.engine = Engine(self.state, self.logger, algorithms, callbacks)
        self.engine.run_event(Event.INIT)
        self._preemption = Preemption()
        self._preempted = False
        self._signalled = False  # preemption agreed by all ranks (`_global_counts`)
        # One process: the first batch without loss tokens, on the device (-1: none yet).
        self._no_loss_tokens = torch.full((), -1, dtype=torch.long, device=self.state.device)
        # RNG states of a loaded checkpoint still to be restored (see `load`).
        self._resume_rng: dict[str, Any] | None = None
        if load_path:
            self.load(load_path, load_ignore_keys)

    def load(self, path: str, ignore_keys: Sequence[str] = ()) -> None:
        """Continue from the checkpoint at `path` (a checkpoint folder, or a save folder's
        `latest`), except `ignore_keys` (llmfoundry/checkpoint/state_dict.py).

        RNG states are restored where the interrupted run was when it saved them: states saved
        after a batch once the epoch's data iterator exists (creating one may draw a seed, which
        the interrupted run drew before saving), states saved at an epoch boundary right away.
        """
        self.engine.run_event(Event.BEFORE_LOAD)
        rng = load_checkpoint(path, self.state, self.logger, ignore_keys)
        if rng is not None and self.state.timestamp.batch_in_epoch == 0:
            load_rng_state(rng, self.state.device)
            rng = None
        self._resume_rng = rng
        ts = self.state.timestamp
        log.info("loaded checkpoint %s (epoch %d, batch %d)", path, ts.epoch, ts.batch)
        self.engine.run_event(Event.AFTER_LOAD)

    # ------------------------------------------------------------------ training
    def fit(self) -> State:
        state = self.state
        try:
            with self._preemption:
                self.engine.run_event(Event.FIT_START)
                if self.eval_first and state.timestamp.batch == 0:
                    self.evaluate()
                while not state.finished:
                    self._train_epoch()
                self._check_loss_tokens()
                if self._preempted:  # saved at BATCH_CHECKPOINT; resumable, so no FIT_END
                    log.info("preempted: stopped after batch %d", state.timestamp.batch)
                    return state
                if state.eval_dataloaders and self._last_eval_batch != state.timestamp.batch:
                    self.evaluate()
                self.engine.run_event(Event.FIT_END)
        finally:
            self.close()
        return state

    def _train_epoch(self) -> None:
        state = self.state
        # The loader's set_epoch (llmfoundry.data's contract), else its dataset's.
        loader = state.train_dataloader
        dataset = getattr(loader, "dataset", None)
        set_epoch = getattr(loader, "set_epoch", None) or getattr(dataset, "set_epoch", None)
        if set_epoch is not None:
            set_epoch(state.timestamp.epoch)
        self.engine.run_event(Event.EPOCH_START)
        epoch_start = copy.copy(state.timestamp)
        saw_batch = False
        for _ in self._batches(state.train_dataloader):
            saw_batch = True
            before = copy.copy(state.timestamp)
            self.engine.run_event(Event.BATCH_START)
            self._train_batch()
            self.engine.run_event(Event.BATCH_END)
            if self._preemption_requested():
                self._preempted = state.stop_training = True
            self.engine.run_event(Event.BATCH_CHECKPOINT)
            if self.eval_interval and state.crossed(self.eval_interval, before):
                self.evaluate()
            if state.finished:
                if state.timestamp.batch_in_epoch != state.dataloader_len:
                    return  # stopped mid-epoch: no epoch end
                break
        # A run resumed at the end of an epoch has no batch left in it; that is no error.
        if not saw_batch and state.timestamp.batch_in_epoch == 0:
            raise UserError(
                "the train dataloader yielded no batch: the dataset is smaller than one global "
                "batch per rank, or empty; check data.remote and global_train_batch_size"
            )
        state.timestamp.after_epoch()
        self.engine.run_event(Event.EPOCH_END)
        self.engine.run_event(Event.EPOCH_CHECKPOINT)
        # Epoch-based intervals fire here; other units were handled after each batch.
        interval = self.eval_interval
        if interval and interval.unit is TimeUnit.EPOCH and state.crossed(interval, epoch_start):
            self.evaluate()

    def _batches(self, dataloader: Iterable[dict[str, torch.Tensor]]) -> Iterator[None]:
        """Fetch batches onto the device, wrapped in the dataloader events."""
        iterator = iter(dataloader)
        if self._resume_rng is not None:  # see `load`
            load_rng_state(self._resume_rng, self.state.device)
            self._resume_rng = None
        while True:
            self.engine.run_event(Event.BEFORE_DATALOADER)
            try:
                batch = next(iterator)
            except StopIteration:
                return
            self.state.batch = {
                k: v.to(self.state.device, non_blocking=True) for k, v in batch.items()
            }
            self.engine.run_event(Event.AFTER_DATALOADER)
            yield

    def _preemption_requested(self) -> bool:
        """Whether any rank got SIGTERM/SIGINT; all ranks agree, so they stop at one batch.

        One process looks after each batch. Several learn it from the step's count all-reduce
        (`_global_counts`, no collective of its own), so a signal that arrives after that
        all-reduce stops them one batch later.
        """
        if self.strategy.world_size == 1:
            return self._preemption.signal is not None
        return self._signalled

    def _global_counts(self, labels: torch.Tensor) -> tuple[int, int, torch.Tensor]:
        """Samples and tokens of the global batch (numbers: the timestamp needs them), and its
        loss tokens (a device tensor: only the loss weighting needs them).

        One process takes the first two from the shape and never waits for the device; a batch
        without loss tokens is recorded on the device and reported at the next evaluation or the
        end of training (`_check_loss_tokens`). Several processes need one all-reduce for the
        counts anyway, over the data-parallel group (the other axes' ranks read the same batch):
        it carries the preemption flag too, which every process must agree on, so a mesh with
        more processes than data-parallel ranks agrees on it in an all-reduce of its own.
        Reading it is the step's one host sync (a batch without loss tokens fails right there).
        """
        state = self.state
        loss_tokens = loss_token_count(labels).double()
        if self.strategy.world_size == 1:
            empty = (self._no_loss_tokens < 0) & (loss_tokens == 0)
            self._no_loss_tokens = torch.where(empty, state.timestamp.batch, self._no_loss_tokens)
            return labels.shape[0], labels.numel(), loss_tokens
        signalled = float(self._preemption.signal is not None)
        local = torch.tensor(
            [labels.shape[0], labels.numel(), signalled], dtype=torch.float64, device=state.device
        )
        strategy = self.strategy
        counts = strategy.all_reduce_sum(torch.cat([local, loss_tokens[None]]), strategy.dp_group)
        if strategy.dp_size != strategy.world_size:
            strategy.all_reduce_sum(counts[2:3])
        samples, tokens, signalled, total_loss_tokens = counts.tolist()
        self._signalled = signalled > 0
        if total_loss_tokens == 0:
            raise UserError(
                f"training batch {state.timestamp.batch + 1} has no loss tokens: every label is "
                "-100"
            )
        return int(samples), int(tokens), counts[3]

    def _check_loss_tokens(self) -> None:
        """Raise if a batch had no loss tokens (one process; `_global_counts`)."""
        batch = int(self._no_loss_tokens)
        if batch >= 0:
            raise UserError(
                f"training batch {batch + 1} had no loss tokens (every label is -100); its step "
                "changed nothing but the optimizer's state. Check the data and its label masking"
            )

    def _train_batch(self) -> None:
        """One optimizer step over the batch, split into microbatches.

        Each microbatch's loss is weighted by its share of the loss tokens of the whole global
        batch (all data-parallel ranks), so the update equals the one a single large batch would
        give.

        With auto-microbatching, an out-of-memory error in any rank's forward or backward
        discards the partial step on every rank (the ranks agree through an all-reduce of an
        OOM flag after each attempt), halves the microbatch size and retries the same batch.
        Gradients are then averaged across ranks only after that agreement, so no rank is ever
        left inside a collective that another rank abandoned; a strategy with collectives inside
        forward and backward (sharding) agrees before each (`Strategy.guard_collectives`) until
        the size has fit `SETTLE_STEPS` steps, and an out-of-memory error after that is raised
        (`_out_of_memory_after_settling`).
        """
        state, engine = self.state, self.engine
        started = time.perf_counter()
        batch = state.batch
        _check_batch_shape(batch["labels"])
        samples, tokens, loss_tokens = self._global_counts(batch["labels"])
        engine.run_event(Event.BEFORE_TRAIN_BATCH)
        if self.auto_microbatching and state.device_train_microbatch_size is None:
            state.device_train_microbatch_size = batch["labels"].shape[0]
        while True:
            try:
                loss_sum = self._accumulate_gradients(batch, loss_tokens)
                out_of_memory = agreed = False
            except RuntimeError as err:  # torch.OutOfMemoryError is a RuntimeError
                if not (self.auto_microbatching and _is_out_of_memory(err)):
                    raise
                if not self.strategy.out_of_memory_retryable:
                    raise self._out_of_memory_after_settling() from err
                # Learned from another rank at a collective: all ranks agreed there already.
                out_of_memory, agreed = True, isinstance(err, OutOfMemoryElsewhere)
            if not self.auto_microbatching:
                break
            if not agreed and not self._out_of_memory_on_any_rank(out_of_memory):
                self.strategy.sync_gradients(state.model)
                self._log_microbatch_size()
                self._count_step_at_size()
                break
            self._retry_with_smaller_microbatches(batch)
        state.batch = batch
        state.outputs = None
        # On the device: nothing here waits for it (`State.batch_loss`).
        # Over every rank whose loss covers other tokens (data- and context-parallel).
        loss_sum = self.strategy.all_reduce_sum(loss_sum, self.strategy.loss_group)
        state.batch_loss = DeviceScalar(loss_sum / loss_tokens)
        self.precision.unscale(state.optimizer)
        engine.run_event(Event.AFTER_TRAIN_BATCH)
        self._set_lr()
        self.strategy.step(state.optimizer, self.precision)
        self.strategy.zero_grad(state.optimizer)
        state.timestamp.after_batch(samples, tokens, time.perf_counter() - started)
        model_metrics = self.train_metrics() if self.train_metrics is not None else {}
        self.logger.log_metrics({"loss/train": state.batch_loss, **model_metrics})

    def _accumulate_gradients(
        self, batch: dict[str, torch.Tensor], loss_tokens: torch.Tensor
    ) -> torch.Tensor:
        """Forward and backward over each microbatch; returns the loss summed over loss tokens.

        Gradients are averaged across ranks during the last microbatch's backward, except under
        auto-microbatching, where `_train_batch` averages them once every rank has succeeded.
        """
        if self.strategy.pipeline is not None:
            return self._pipeline_step(batch, loss_tokens)
        state, engine, context = self.state, self.engine, self.strategy.context
        microbatches = list(self._microbatches(batch))
        # float32 as the microbatch losses; at least 1, so a batch without loss tokens (an error,
        # found by `_global_counts` or `_check_loss_tokens`) gives zero gradients, not NaN.
        divisor = loss_tokens.float().clamp(min=1)
        loss_sum = torch.zeros((), dtype=torch.float64, device=state.device)
        for index, microbatch in enumerate(microbatches):
            sync = index == len(microbatches) - 1 and not self.auto_microbatching
            # Context parallel: the model, the loss and its count take this rank's part of each
            # sequence (state.batch stays the whole microbatch, which callbacks read).
            local = microbatch if context is None else context.shard(microbatch)
            with self.strategy.sync_context(state.model, sync):
                state.batch = microbatch
                engine.run_event(Event.BEFORE_FORWARD)
                with self.precision.autocast():
                    state.outputs = state.model(local)
                engine.run_event(Event.AFTER_FORWARD)
                engine.run_event(Event.BEFORE_LOSS)
                with self.precision.autocast():
                    state.loss = self.loss_fn(state.outputs, local)
                engine.run_event(Event.AFTER_LOSS)
                mb_tokens = loss_token_count(local)
                # Gradients are averaged over the ranks whose losses cover different tokens
                # (data- and context-parallel): undo their mean.
                weight = mb_tokens * self.strategy.loss_size / divisor
                engine.run_event(Event.BEFORE_BACKWARD)
                self.strategy.backward(state.loss * weight, self.precision)
                engine.run_event(Event.AFTER_BACKWARD)
                state.outputs = None  # the logits: not held through the next forward or step
            loss_sum += state.loss.detach().double() * mb_tokens
        return loss_sum

    def _pipeline_step(
        self, batch: dict[str, torch.Tensor], loss_tokens: torch.Tensor
    ) -> torch.Tensor:
        """`_accumulate_gradients` under pipeline parallelism: the strategy's schedule runs the
        microbatches' forwards, losses and backwards, interleaved across the stages, each loss
        weighted as there. So BEFORE_FORWARD fires before the step and AFTER_BACKWARD after it
        (state.loss: the device batch's mean loss), once per step; the events between do not
        fire (llmfoundry/core/events.md)."""
        state, engine, context = self.state, self.engine, self.strategy.context
        divisor = loss_tokens.float().clamp(min=1)
        loss_size = self.strategy.loss_size
        # Context parallel: the stages run this rank's part of each sequence (by rows, so the
        # schedule's microbatches are the parts of the trainer's).
        local = batch if context is None else context.shard(batch)

        def weight(targets: Mapping[str, torch.Tensor]) -> torch.Tensor:  # as in the loop
            return loss_token_count(targets) * loss_size / divisor

        state.batch = batch
        engine.run_event(Event.BEFORE_FORWARD)
        with self.precision.autocast():
            loss_sum = self.strategy.pipeline.step(
                local, state.device_train_microbatch_size, self.loss_fn, weight
            )
        state.loss = (loss_sum / loss_token_count(local).clamp(min=1)).float()
        engine.run_event(Event.AFTER_BACKWARD)
        return loss_sum

    def _microbatches(self, batch: dict[str, torch.Tensor]) -> Iterator[dict[str, torch.Tensor]]:
        for rows in _row_slices(batch["labels"].shape[0], self.state.device_train_microbatch_size):
            yield {k: v[rows] for k, v in batch.items()}

    def _out_of_memory_on_any_rank(self, out_of_memory: bool) -> bool:
        flag = torch.tensor([float(out_of_memory)], device=self.state.device)
        return self.strategy.all_reduce_sum(flag).item() > 0

    def _count_step_at_size(self) -> None:
        """The size has fit one more step; at `SETTLE_STEPS` the strategy's guards come off."""
        self._steps_at_size += 1
        if self._steps_at_size == SETTLE_STEPS:
            self.strategy.guard_collectives(self.state.model, guard=False)

    def _out_of_memory_after_settling(self) -> RuntimeError:
        """An out-of-memory error once the size settled, with the guards off: the other ranks
        may wait in a collective this rank will not reach, so this rank joins no agreement and
        ends the run (torchrun then stops the others) rather than hang them."""
        size = self.state.device_train_microbatch_size
        return RuntimeError(
            f"out of memory at device_train_microbatch_size={size} (auto) after it had fit "
            f"{self._steps_at_size} steps: the other ranks wait in a collective this rank left, "
            f"so the step cannot be retried; set device_train_microbatch_size={max(size // 2, 1)}"
            ", or resume the run with auto (it searches again)"
        )

    def _retry_with_smaller_microbatches(self, batch: dict[str, torch.Tensor]) -> None:
        """Free the failed attempt (gradients, outputs, cached blocks) and halve the microbatch."""
        state = self.state
        self._steps_at_size = 0
        self.strategy.abandon_step(state.model, state.optimizer)
        state.batch, state.outputs, state.loss = batch, None, None
        if state.device.type == "cuda":
            torch.cuda.empty_cache()
        size = state.device_train_microbatch_size
        if size <= 1:
            raise RuntimeError(
                "out of memory with device_train_microbatch_size=1 (auto): one sample per "
                "device does not fit. Lower max_seq_len, use precision=amp_bf16, a smaller "
                "model, or a strategy that shards the model."
            )
        state.device_train_microbatch_size = size // 2
        log.info(
            "out of memory with device_train_microbatch_size=%d on some rank; retrying the "
            "batch with %d",
            size,
            size // 2,
        )

    def _log_microbatch_size(self) -> None:
        size = self.state.device_train_microbatch_size
        if size == self._logged_microbatch_size:
            return
        self._logged_microbatch_size = size
        self.logger.log_metrics({"trainer/device_train_microbatch_size": size})
        log.info("device_train_microbatch_size (auto): %d", size)

    def _set_lr(self) -> None:
        """Set each group's lr from the schedule, for the step about to be taken."""
        if self.schedule is None:
            return
        multiplier = self.schedule(self.state)
        for group in self.state.optimizer.param_groups:
            group["lr"] = group["initial_lr"] * multiplier

    # ---------------------------------------------------------------- evaluation
    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Run every eval set; metrics land in ``state.eval_metrics`` as eval/<name>/<metric>."""
        state, engine = self.state, self.engine
        pipeline = self.strategy.pipeline
        self._check_loss_tokens()
        train_batch = state.batch
        # Evaluating (more or less often) must not change training's randomness.
        rng = rng_state(state.device)
        state.model.eval()
        engine.run_event(Event.EVAL_BEFORE_ALL)
        for name, value in state.eval_dataloaders.items():
            state.eval_name = name
            evalset = eval_set(value, self.default_metrics)
            metrics = evalset.metrics(state.device)
            engine.run_event(Event.EVAL_START)
            for index, batch in enumerate(evalset.dataloader):
                if (
                    self.eval_subset_num_batches is not None
                    and index >= self.eval_subset_num_batches
                ):
                    self._note_subset(name, evalset.dataloader)
                    break
                batch, sample_mask = _split_sample_mask(batch, state.device)
                state.batch = batch
                engine.run_event(Event.EVAL_BATCH_START)
                for rows in _row_slices(sample_mask.shape[0], self.device_eval_microbatch_size):
                    microbatch = {k: v[rows] for k, v in batch.items()}
                    self._eval_forward(metrics, microbatch, sample_mask[rows])
                state.batch = batch
                engine.run_event(Event.EVAL_BATCH_END)
            if pipeline is not None:
                pipeline.sum_over_stages(metrics.totals)
            self.strategy.all_reduce_sum(metrics.totals, self.strategy.loss_group)
            results = {f"eval/{name}/{key}": value for key, value in metrics.compute().items()}
            state.eval_metrics.update(results)
            self.logger.log_metrics(results)
            engine.run_event(Event.EVAL_END)
        state.eval_name = None
        state.outputs = None
        engine.run_event(Event.EVAL_AFTER_ALL)
        state.model.train()
        state.batch = train_batch
        load_rng_state(rng, state.device)
        self._last_eval_batch = state.timestamp.batch
        return dict(state.eval_metrics)

    def _note_subset(self, name: str, dataloader: Any) -> None:
        """Say once per eval set that its metrics are of a subset (eval_subset_num_batches cut
        it short), so they are never mistaken for the whole set's."""
        if name in self._subset_noted or self.state.rank != 0:  # every rank's subset is alike
            return
        self._subset_noted.add(name)
        try:
            total = f"{len(dataloader)}"
        except TypeError:  # an iterable without a length
            total = f"more than {self.eval_subset_num_batches}"
        n = self.eval_subset_num_batches
        log.warning(
            "eval/%s: evaluated %d of %s batches (eval_subset_num_batches=%d): its metrics are "
            "of that subset; eval_subset_num_batches=null evaluates the whole set",
            name, n, total, n,
        )  # fmt: skip

    def _eval_forward(
        self, metrics: Metrics, microbatch: dict[str, torch.Tensor], sample_mask: torch.Tensor
    ) -> None:
        """One eval forward and its metrics. The previous forward's outputs are dropped first,
        so two microbatches' logits are never held at once."""
        state, engine, pipeline = self.state, self.engine, self.strategy.pipeline
        context = self.strategy.context  # as in training: this rank's part of each sequence
        local = microbatch if context is None else context.shard(microbatch)
        state.batch, state.outputs = microbatch, None
        engine.run_event(Event.EVAL_BEFORE_FORWARD)
        with self.precision.autocast():
            state.outputs = (
                state.model(local)
                if pipeline is None
                else pipeline.forward_only(local)  # None but on the last stage
            )
        engine.run_event(Event.EVAL_AFTER_FORWARD)
        if state.outputs is not None:
            metrics.update(state.outputs, local, sample_mask)

    def close(self) -> None:
        self.engine.close()
        self.strategy.teardown()


def _split_sample_mask(
    batch: Mapping[str, torch.Tensor], device: torch.device
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The eval batch on `device` without its ``sample_mask``, and the mask (all True if absent).

    The mask is the metrics' business only: the model never sees it.
    """
    batch = {k: v.to(device) for k, v in batch.items()}
    mask = batch.pop(SAMPLE_MASK, None)
    rows = next(iter(batch.values())).shape[0]
    if mask is None:
        return batch, torch.ones(rows, dtype=torch.bool, device=device)
    if mask.dtype != torch.bool or mask.shape != (rows,):
        raise ValueError(
            f"an eval batch's {SAMPLE_MASK!r} must be a bool tensor of shape [{rows}] (one flag "
            f"per sample), got {mask.dtype} of shape {tuple(mask.shape)}"
        )
    return batch, mask


def _check_pipeline_options(precision: str, microbatch_size: int | str | None) -> None:
    """Refuse, before any process waits, what pipeline parallelism does not support yet."""
    if microbatch_size == "auto":
        raise UserError(
            "device_train_microbatch_size=auto is not supported with parallelism.pp > 1 (the "
            "schedule's microbatches are fixed); set an integer"
        )
    if precision == "amp_fp16":
        raise UserError(
            "precision=amp_fp16 (loss scaling) is not supported with parallelism.pp > 1; use "
            "amp_bf16"
        )


def _row_slices(rows: int, size: int | None) -> Iterator[slice]:
    """Consecutive slices of `size` of `rows` rows (None: one slice of all of them)."""
    step = size or max(rows, 1)
    for start in range(0, rows, step):
        yield slice(start, start + step)


def _is_auto(microbatch_size: int | str | None) -> bool:
    if isinstance(microbatch_size, str):
        if microbatch_size != "auto":
            raise UserError(
                f"device_train_microbatch_size={microbatch_size!r}: use a positive integer, "
                "null (the whole per-device batch) or 'auto'"
            )
        return True
    if microbatch_size is not None and microbatch_size < 1:
        raise UserError(f"device_train_microbatch_size must be positive, got {microbatch_size}")
    return False


def _is_out_of_memory(err: RuntimeError) -> bool:
    """CUDA and other backends raise torch.OutOfMemoryError; some only say so in the message."""
    return isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower()


def _check_batch_shape(labels: torch.Tensor) -> None:
    """Refuse labels that are not [batch, seq]: one sample (a torch DataLoader with
    batch_size=None over a dataset of samples) is otherwise an IndexError deep in a step."""
    if labels.dim() != 2:
        raise UserError(
            f"a training batch's labels have shape {list(labels.shape)}, not [batch, seq]: the "
            "train dataloader yields single samples; use StreamingDataLoader(dataset) (a "
            "dataset built with batch_size) or torch's DataLoader(dataset, batch_size=B)"
        )


def _length(dataloader: Any) -> int | None:
    try:
        return len(dataloader)
    except TypeError:
        return None

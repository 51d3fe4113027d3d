"""The fit loop. It names its events and leaves every optional feature to algorithms and callbacks.

Reading order: `fit` (epochs and batches), `_train_batch` (microbatches, backward, optimizer
step), `evaluate` (each eval set). Where each event fires is listed in `events.md`.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from llmfoundry.distributed import SingleDevice, Strategy
from llmfoundry.trainer.engine import Algorithm, Callback, Engine, Logger, LoggerDestination
from llmfoundry.trainer.events import Event
from llmfoundry.trainer.metrics import IGNORE_INDEX, LanguageMetrics
from llmfoundry.trainer.precision import Precision
from llmfoundry.trainer.rng import seed_all
from llmfoundry.trainer.state import State
from llmfoundry.trainer.time import Time, TimeUnit

OptimizerFactory = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]
Schedule = Callable[[State], float]


class Trainer:
    """Trains `model` on batches of ``{"input_ids", "labels"}``.

    The model is handed over unprepared (typically built on the meta device); the strategy
    materializes and wraps it, and only then is the optimizer built from `optimizer`, a factory
    taking the parameters (Hydra's ``_partial_: true``), so sharded strategies can replace
    parameters before the optimizer sees them.

    `scheduler` maps the state to a learning-rate multiplier of each group's initial lr.
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
        eval_dataloaders: Mapping[str, Iterable[dict[str, torch.Tensor]]] | None = None,
        eval_interval: str | Time | None = None,
        eval_first: bool = False,
        eval_subset_num_batches: int | None = None,
        algorithms: Sequence[Algorithm] = (),
        callbacks: Sequence[Callback] = (),
        loggers: Sequence[LoggerDestination] = (),
        precision: str = "fp32",
        device_train_microbatch_size: int | None = None,
        seed: int = 17,
        config: dict[str, Any] | None = None,
    ) -> None:
        self.strategy = strategy or SingleDevice()
        self.strategy.setup()
        seed_all(seed + self.strategy.rank)
        self.loss_fn = model.loss
        prepared = self.strategy.prepare(model)
        opt = optimizer(prepared.parameters())
        for group in opt.param_groups:
            group.setdefault("initial_lr", group["lr"])
        self.schedule = scheduler
        self.precision = Precision(precision, self.strategy.device)
        self.eval_interval = Time.parse(eval_interval) if eval_interval else None
        self.eval_first = eval_first
        self.eval_subset_num_batches = eval_subset_num_batches
        self._last_eval_batch = -1
        self.state = State(
            model=prepared,
            optimizer=opt,
            scheduler=scheduler,
            max_duration=Time.parse(max_duration),
            run_dir=Path(run_dir),
            device=self.strategy.device,
            precision=precision,
            rank=self.strategy.rank,
            world_size=self.strategy.world_size,
            seed=seed,
            train_dataloader=train_dataloader,
            eval_dataloaders=dict(eval_dataloaders or {}),
            dataloader_len=_length(train_dataloader),
            device_train_microbatch_size=device_train_microbatch_size,
            config=config or {},
        )
        self.logger = Logger(self.state, loggers)
        self.engine = Engine(self.state, self.logger, algorithms, callbacks)
        self.engine.run_event(Event.INIT)

    # ------------------------------------------------------------------ training
    def fit(self) -> State:
        state = self.state
        try:
            self.engine.run_event(Event.FIT_START)
            if self.eval_first and state.timestamp.batch == 0:
                self.evaluate()
            while not state.finished:
                self._train_epoch()
            if state.eval_dataloaders and self._last_eval_batch != state.timestamp.batch:
                self.evaluate()
            self.engine.run_event(Event.FIT_END)
        finally:
            self.close()
        return state

    def _train_epoch(self) -> None:
        state = self.state
        set_epoch = getattr(getattr(state.train_dataloader, "dataset", None), "set_epoch", None)
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
            self.engine.run_event(Event.BATCH_CHECKPOINT)
            if self.eval_interval and state.crossed(self.eval_interval, before):
                self.evaluate()
            if state.finished:
                if state.timestamp.batch_in_epoch != state.dataloader_len:
                    return  # stopped mid-epoch: no epoch end
                break
        if not saw_batch:
            raise ValueError(
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
        while True:
            self.engine.run_event(Event.BEFORE_DATALOADER)
            try:
                batch = next(iterator)
            except StopIteration:
                return
            self.state.batch = {k: v.to(self.state.device, non_blocking=True) for k, v in batch.items()}
            self.engine.run_event(Event.AFTER_DATALOADER)
            yield

    def _train_batch(self) -> None:
        """One optimizer step over the batch, split into microbatches.

        Each microbatch's loss is weighted by its share of the loss tokens of the whole global
        batch (all ranks), so the update equals the one a single large batch would give.
        """
        state, engine = self.state, self.engine
        started = time.perf_counter()
        batch = state.batch
        labels = batch["labels"]
        counts = torch.tensor(
            [labels.shape[0], labels.numel(), (labels[:, 1:] != IGNORE_INDEX).sum().item()],
            dtype=torch.float64,
            device=state.device,
        )
        samples, tokens, loss_tokens = self.strategy.all_reduce_sum(counts).tolist()
        if loss_tokens == 0:
            raise ValueError("a training batch has no loss tokens: every label is -100")
        engine.run_event(Event.BEFORE_TRAIN_BATCH)
        loss_sum = torch.zeros((), dtype=torch.float64, device=state.device)
        for microbatch in self._microbatches(batch):
            state.batch = microbatch
            engine.run_event(Event.BEFORE_FORWARD)
            with self.precision.autocast():
                state.outputs = state.model(
                    microbatch["input_ids"], sequence_id=microbatch.get("sequence_id")
                )
            engine.run_event(Event.AFTER_FORWARD)
            engine.run_event(Event.BEFORE_LOSS)
            with self.precision.autocast():
                state.loss = self.loss_fn(state.outputs, microbatch["labels"])
            engine.run_event(Event.AFTER_LOSS)
            mb_tokens = (microbatch["labels"][:, 1:] != IGNORE_INDEX).sum()
            weight = mb_tokens * self.strategy.world_size / loss_tokens
            engine.run_event(Event.BEFORE_BACKWARD)
            self.precision.backward(state.loss * weight)
            engine.run_event(Event.AFTER_BACKWARD)
            loss_sum += state.loss.detach().double() * mb_tokens
        state.batch = batch
        state.outputs = None
        state.train_loss = self.strategy.all_reduce_sum(loss_sum).item() / loss_tokens
        self.precision.unscale(state.optimizer)
        engine.run_event(Event.AFTER_TRAIN_BATCH)
        self._set_lr()
        self.precision.step(state.optimizer)
        state.optimizer.zero_grad(set_to_none=True)
        state.timestamp.after_batch(int(samples), int(tokens), time.perf_counter() - started)

    def _microbatches(self, batch: dict[str, torch.Tensor]) -> Iterator[dict[str, torch.Tensor]]:
        size = self.state.device_train_microbatch_size or batch["input_ids"].shape[0]
        n = batch["input_ids"].shape[0]
        for start in range(0, n, size):
            yield {k: v[start : start + size] for k, v in batch.items()}

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
        train_batch = state.batch
        state.model.eval()
        engine.run_event(Event.EVAL_BEFORE_ALL)
        for name, dataloader in state.eval_dataloaders.items():
            state.eval_name = name
            metrics = LanguageMetrics(state.device)
            engine.run_event(Event.EVAL_START)
            for index, batch in enumerate(dataloader):
                if self.eval_subset_num_batches is not None and index >= self.eval_subset_num_batches:
                    break
                state.batch = {k: v.to(state.device) for k, v in batch.items()}
                engine.run_event(Event.EVAL_BATCH_START)
                engine.run_event(Event.EVAL_BEFORE_FORWARD)
                with self.precision.autocast():
                    state.outputs = state.model(
                        state.batch["input_ids"], sequence_id=state.batch.get("sequence_id")
                    )
                engine.run_event(Event.EVAL_AFTER_FORWARD)
                metrics.update(state.outputs, state.batch["labels"])
                engine.run_event(Event.EVAL_BATCH_END)
            self.strategy.all_reduce_sum(metrics.totals)
            results = {f"eval/{name}/{key}": value for key, value in metrics.compute().items()}
            state.eval_metrics.update(results)
            self.logger.log_metrics(results)
            engine.run_event(Event.EVAL_END)
        state.eval_name = None
        state.outputs = None
        engine.run_event(Event.EVAL_AFTER_ALL)
        state.model.train()
        state.batch = train_batch
        self._last_eval_batch = state.timestamp.batch
        return dict(state.eval_metrics)

    def close(self) -> None:
        self.engine.close()
        self.strategy.teardown()


def _length(dataloader: Any) -> int | None:
    try:
        return len(dataloader)
    except TypeError:
        return None

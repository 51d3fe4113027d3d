"""Auto-microbatching in one process, with out-of-memory errors injected at chosen sizes.

The two-process case (one rank runs out of memory, both must agree) is in
tests/distributed/test_ddp.py.
"""

import functools
import logging
from pathlib import Path

import pytest
import torch

from llmfoundry.config import ConfigError
from llmfoundry.config.preflight import check
from llmfoundry.distributed import SingleDevice
from llmfoundry.trainer import Algorithm, Callback, Event, LoggerDestination, Trainer

from .conftest import tiny_model, token_batches


class InjectOOM(Algorithm):
    """Raise an out-of-memory error at `event` when a microbatch has more than `limit` samples,
    from batch `from_batch` on (a real OOM cannot be provoked reliably on CPU)."""

    def __init__(self, limit, event=Event.BEFORE_FORWARD, from_batch=0, error=None):
        self.limit, self.event, self.from_batch = limit, event, from_batch
        self.error = error or (lambda: torch.OutOfMemoryError("CUDA out of memory (injected)"))
        self.raised = 0

    def match(self, event, state):
        return event is self.event and state.timestamp.batch >= self.from_batch

    def apply(self, event, state, logger):
        if state.batch["input_ids"].shape[0] > self.limit:
            self.raised += 1
            raise self.error()


class Metrics(LoggerDestination):
    def __init__(self):
        self.logged = []

    def log_metrics(self, metrics, step):
        self.logged += [(step, k, v) for k, v in metrics.items()]


class ForwardSizes(Algorithm):
    """Listed before InjectOOM, it sees every attempted microbatch, the failing ones too."""

    def __init__(self):
        self.sizes = []

    def match(self, event, state):
        return event is Event.BEFORE_FORWARD

    def apply(self, event, state, logger):
        self.sizes.append((state.timestamp.batch, state.batch["input_ids"].shape[0]))


def masked_batches(n=2):
    """Unequal loss tokens per sample, so wrong microbatch weighting would show."""
    batches = token_batches(n, 4, seed=3)
    for batch in batches:
        batch["labels"][0, :12] = -100
        batch["labels"][3, 5:] = -100
    return batches


def train(tmp_path, batches, **kwargs):
    # fp32: these compare with one large batch at 1e-5, and auto is bf16 where the default
    # device is a GPU.
    kwargs.setdefault("precision", "fp32")
    trainer = Trainer(
        model=tiny_model(),
        train_dataloader=batches,
        max_duration=f"{len(batches)}ba",
        optimizer=functools.partial(torch.optim.SGD, lr=0.1),
        run_dir=tmp_path,
        **kwargs,
    )
    trainer.fit()
    return trainer


def assert_same_params(a, b):
    for (name, x), (_, y) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6, msg=name)


def test_oom_in_forward_halves_until_it_fits_and_matches_one_large_batch(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="llmfoundry")
    oom, sizes, metrics = InjectOOM(limit=1), ForwardSizes(), Metrics()
    trainer = train(
        tmp_path,
        masked_batches(),
        device_train_microbatch_size="auto",
        algorithms=[sizes, oom],
        loggers=[metrics],
    )
    assert trainer.state.device_train_microbatch_size == 1
    # Batch 0: tries 4, then 2, then four microbatches of 1; batch 1 starts at the kept size 1.
    assert sizes.sizes == [(0, 4), (0, 2)] + [(0, 1)] * 4 + [(1, 1)] * 4
    assert oom.raised == 2
    assert [
        (s, v) for s, k, v in metrics.logged if k == "trainer/device_train_microbatch_size"
    ] == [(0, 1)]
    out = caplog.text
    assert "retrying the batch with 2" in out and "retrying the batch with 1" in out
    assert "device_train_microbatch_size (auto): 1" in out
    reference = train(tmp_path, masked_batches())
    assert_same_params(trainer.state.model, reference.state.model)
    assert trainer.state.train_loss == pytest.approx(reference.state.train_loss, rel=1e-6)


def test_oom_in_backward_discards_the_partial_gradients(tmp_path):
    # The failed attempt has already accumulated a full batch of gradients when it raises; the
    # retry must start from zero or the step would be doubled.
    oom = InjectOOM(limit=2, event=Event.AFTER_BACKWARD)
    trainer = train(
        tmp_path, masked_batches(), device_train_microbatch_size="auto", algorithms=[oom]
    )
    assert trainer.state.device_train_microbatch_size == 2 and oom.raised == 1
    assert_same_params(trainer.state.model, train(tmp_path, masked_batches()).state.model)


def test_size_is_kept_and_halved_again_later(tmp_path):
    oom, sizes, metrics = InjectOOM(limit=2, from_batch=1), ForwardSizes(), Metrics()
    train(
        tmp_path,
        token_batches(3, 4),
        device_train_microbatch_size="auto",
        algorithms=[sizes, oom],
        loggers=[metrics],
    )
    assert sizes.sizes == [(0, 4), (1, 4), (1, 2), (1, 2), (2, 2), (2, 2)]
    logged = [(s, v) for s, k, v in metrics.logged if k == "trainer/device_train_microbatch_size"]
    assert logged == [(0, 4), (1, 2)]


def test_oom_message_without_the_oom_type_counts_too(tmp_path):
    oom = InjectOOM(limit=2, error=lambda: RuntimeError("HIP error: out of memory"))
    trainer = train(
        tmp_path, token_batches(1, 4), device_train_microbatch_size="auto", algorithms=[oom]
    )
    assert trainer.state.device_train_microbatch_size == 2


def test_oom_at_size_one_is_a_clear_error(tmp_path):
    with pytest.raises(
        RuntimeError, match="device_train_microbatch_size=1 .*one sample per device"
    ):
        train(
            tmp_path,
            token_batches(1, 4),
            device_train_microbatch_size="auto",
            algorithms=[InjectOOM(0)],
        )


def test_other_errors_and_fixed_sizes_are_not_retried(tmp_path):
    boom = InjectOOM(limit=0, error=lambda: RuntimeError("boom"))
    with pytest.raises(RuntimeError, match="^boom$"):
        train(tmp_path, token_batches(1, 4), device_train_microbatch_size="auto", algorithms=[boom])
    oom = InjectOOM(limit=1)
    with pytest.raises(torch.OutOfMemoryError):
        train(tmp_path, token_batches(1, 4), device_train_microbatch_size=2, algorithms=[oom])
    assert oom.raised == 1


@pytest.mark.parametrize("bad", ["big", 0])
def test_bad_microbatch_setting(tmp_path, bad):
    with pytest.raises(ValueError, match="device_train_microbatch_size"):
        train(tmp_path, token_batches(1, 4), device_train_microbatch_size=bad)


class Guarded(SingleDevice):
    """One process standing in for a sharded strategy (FSDP): its guards are recorded with the
    batch they were set at, and an out-of-memory error can be agreed on only while they are on."""

    def __init__(self) -> None:
        super().__init__("cpu")
        self.guards: list[tuple[int, bool]] = []
        self.agreements = 0
        self.batch = lambda: -1

    def guard_collectives(self, model, guard=True):
        self.guards.append((self.batch(), guard))

    @property
    def out_of_memory_retryable(self) -> bool:
        return self.guards[-1][1]

    def all_reduce_sum(self, tensor, group=None):
        self.agreements += 1
        return tensor


def guarded_run(tmp_path, n_batches, oom, callbacks=()):
    strategy = Guarded()
    trainer = Trainer(
        model=tiny_model(),
        train_dataloader=token_batches(n_batches, 4),
        max_duration=f"{n_batches}ba",
        optimizer=functools.partial(torch.optim.SGD, lr=0.1),
        run_dir=tmp_path,
        strategy=strategy,
        device_train_microbatch_size="auto",
        algorithms=[oom],
        callbacks=callbacks,
    )
    strategy.batch = lambda: trainer.state.timestamp.batch
    return trainer, strategy


def test_the_guards_come_off_once_the_size_has_fit_two_steps(tmp_path):
    """Guarding every collective costs a host sync per block; once a size has fit the step
    after the optimizer allocated its state, the strategy drops the guards."""
    trainer, strategy = guarded_run(tmp_path, 4, InjectOOM(limit=2))
    trainer.fit()
    # Set when the trainer is built; off after batch 2 (index 1), the second at size 2.
    assert strategy.guards == [(-1, True), (1, False)]
    assert trainer.state.device_train_microbatch_size == 2


def test_an_out_of_memory_error_after_the_guards_came_off_ends_the_run(tmp_path):
    """The other ranks may be inside a collective this rank left: no agreement is joined (it
    would hang them), the error says what to set instead."""
    agreed = []  # the strategy's all-reduces so far, at the end of each batch

    class Agreements(Callback):
        def batch_end(self, state, logger):
            agreed.append(state.strategy.agreements)

    oom = InjectOOM(limit=2, from_batch=3)
    trainer, strategy = guarded_run(tmp_path, 5, oom, callbacks=[Agreements()])
    with pytest.raises(RuntimeError) as err:
        trainer.fit()
    assert str(err.value) == (
        "out of memory at device_train_microbatch_size=4 (auto) after it had fit 3 steps: the "
        "other ranks wait in a collective this rank left, so the step cannot be retried; set "
        "device_train_microbatch_size=2, or resume the run with auto (it searches again)"
    )
    assert isinstance(err.value.__cause__, torch.OutOfMemoryError) and oom.raised == 1
    assert len(agreed) == 3 and strategy.agreements == agreed[-1]  # none after the error
    assert strategy.guards == [(-1, True), (1, False)]


@pytest.mark.cuda  # a real out-of-memory error needs CUDA
def test_real_cuda_oom_is_recovered(tmp_path):
    """Cap this process's CUDA memory, then give it a batch whose activations cannot fit."""
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_allocated() + 2**30) / total)
    try:
        batches = token_batches(2, 512, seq_len=256, vocab=50000)
        trainer = Trainer(
            model=tiny_model(vocab_size=50000, seq_len=256),
            train_dataloader=batches,
            max_duration="2ba",
            optimizer=functools.partial(torch.optim.SGD, lr=0.1),
            run_dir=tmp_path,
            device_train_microbatch_size="auto",
        )
        trainer.fit()
        assert 1 <= trainer.state.device_train_microbatch_size < 512
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)


def test_config_accepts_auto_and_rejects_other_words():
    conf = Path(__file__).resolve().parents[2] / "conf"
    check(conf, ["device_train_microbatch_size=auto"])
    with pytest.raises(ConfigError, match="^device_train_microbatch_size: expected"):
        check(conf, ["device_train_microbatch_size=big"])

"""Training waits for the device only where a number is needed (issue 12 item 9): between log
intervals a step reads nothing from the device, and a batch without loss tokens is still an
error, found later without a read of its own."""

import runpy
from pathlib import Path

import pytest

from llmfoundry.callbacks import NaNDetector
from llmfoundry.loggers import ConsoleLogger, JSONLLogger
from llmfoundry.trainer import Callback
from llmfoundry.utils.jsonl import read_jsonl

from .conftest import token_batches
from .test_trainer import trainer_for

BENCH = runpy.run_path(str(Path(__file__).resolve().parents[2] / "bench" / "host_sync.py"))


class ReadsPerBatch(Callback):
    """Host reads of tensors (outside torch itself) during each batch, BATCH_END included
    (where loggers write): counted from one batch's BATCH_START to the next's."""

    def __init__(self, counter) -> None:
        self.counter, self.reads = counter, []

    def batch_start(self, state, logger) -> None:
        self.counter.active, self.counter.reads = True, 0

    def batch_checkpoint(self, state, logger) -> None:
        self.reads.append(self.counter.reads)
        self.counter.active = False


def test_steps_between_log_intervals_read_nothing_from_the_device(tmp_path):
    counter = BENCH["Counter"]()
    reads = ReadsPerBatch(counter)
    trainer = trainer_for(
        tmp_path,
        token_batches(8, 2),
        callbacks=[reads, NaNDetector(check_every=4)],
        loggers=[ConsoleLogger("4ba"), JSONLLogger(flush_interval="4ba")],
    )
    with BENCH["instrumented"](counter):
        state = trainer.fit()
    quiet = [n for i, n in enumerate(reads.reads) if (i + 1) % 4]
    assert quiet == [0] * 6, reads.reads
    # At an interval: the NaN check, the JSONL flush (all its records in one read) and the
    # console line (the loss already read): at most three.
    assert all(1 <= n <= 3 for n in reads.reads[3::4]), reads.reads
    # The loss read at the end is the last batch's, as the JSONL logger wrote it.
    records = [r for _, r in read_jsonl(str(tmp_path / "metrics.jsonl"))]
    losses = {
        r["step"]: r["metrics"]["loss/train"]
        for r in records
        if "loss/train" in r.get("metrics", {})
    }
    assert sorted(losses) == list(range(1, 9)) and state.train_loss == losses[8]


def test_a_batch_without_loss_tokens_is_reported_by_its_number(tmp_path):
    batches = token_batches(4, 2)
    batches[1]["labels"][:] = -100
    with pytest.raises(ValueError, match="training batch 2 had no loss tokens"):
        trainer_for(tmp_path, batches).fit()

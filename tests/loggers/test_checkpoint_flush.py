"""When a checkpoint counts, every metric up to its step is where the logger keeps it, so a kill
right after it (before the next flush) loses nothing the resumed run would not log again.
End to end, with a SIGKILL and a resume: tests/checkpoint/test_train_script.py."""

import json

import pytest

from llmfoundry.callbacks import CheckpointSaver
from llmfoundry.checkpoint import read_latest
from llmfoundry.loggers import JSONLLogger, TensorBoardLogger
from llmfoundry.trainer import Callback
from tests.callbacks.conftest import make_trainer


def jsonl_steps(run_dir) -> list[int]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return sorted({record["step"] for record in map(json.loads, lines) if "metrics" in record})


def tensorboard_steps(run_dir) -> list[int]:
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    (events_file,) = (run_dir / "tensorboard").glob("events.out.tfevents.*")
    events = accumulator.EventAccumulator(str(events_file))
    events.Reload()
    if "loss/train" not in events.Tags()["scalars"]:
        return []
    return [event.step for event in events.Scalars("loss/train")]


class OnDiskAtCheckpoint(Callback):
    """After the saver, at each batch: the checkpoint `latest` names and the steps on disk, what
    a kill at this moment would leave."""

    def __init__(self, run_dir, steps_on_disk) -> None:
        self.run_dir, self.steps_on_disk = run_dir, steps_on_disk
        self.seen: dict[int, tuple[str | None, list[int]]] = {}

    def batch_checkpoint(self, state, logger) -> None:
        latest = read_latest(str(self.run_dir / "ckpt"))
        self.seen[state.timestamp.batch] = (latest, self.steps_on_disk(self.run_dir))


@pytest.mark.parametrize(
    ("make_logger", "steps_on_disk"),
    [(JSONLLogger, jsonl_steps), (TensorBoardLogger, tensorboard_steps)],
    ids=["jsonl", "tensorboard"],
)
def test_every_step_up_to_a_checkpoint_is_on_disk_when_it_counts(
    tmp_path, make_logger, steps_on_disk
):
    # Flushes are due every 10 batches (and every 30 s for TensorBoard): only saves flush here.
    on_disk = OnDiskAtCheckpoint(tmp_path, steps_on_disk)
    saver = CheckpointSaver(str(tmp_path / "ckpt"), save_interval="2ba")
    make_trainer(
        tmp_path, n_batches=5, callbacks=[saver, on_disk], loggers=[make_logger()]
    ).fit()  # fmt: skip
    assert on_disk.seen[1] == (None, [])
    assert on_disk.seen[2] == ("ep0-ba2", [1, 2])
    assert on_disk.seen[3] == ("ep0-ba2", [1, 2])  # no save, no flush: batch 3 waits
    assert on_disk.seen[4] == ("ep0-ba4", [1, 2, 3, 4])

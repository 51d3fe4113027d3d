import json
import math

from llmfoundry.callbacks import LRMonitor
from llmfoundry.distributed import SingleDevice
from llmfoundry.loggers import JSONLLogger
from llmfoundry.trainer import Callback
from tests.callbacks.conftest import make_trainer
from tests.trainer.conftest import token_batches

CONFIG = {
    "run_name": "r",
    "optimizer": {"lr": 0.1},
    "data": {"storage_options": {"secret": "s3cr3t"}},
}


def read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_one_json_object_per_log_call_in_the_run_folder(tmp_path):
    trainer = make_trainer(
        tmp_path,
        n_batches=3,
        eval_dataloaders={"val": token_batches(1, 4, seed=1)},
        callbacks=[LRMonitor()],
        loggers=[JSONLLogger()],
        config=CONFIG,
    )
    trainer.fit()
    records = read(tmp_path / "metrics.jsonl")
    assert records[0]["hyperparameters"] == {
        "run_name": "r",
        "optimizer": {"lr": 0.1},
        "data": {"storage_options": {}},
    }
    metrics = records[1:]
    # Per batch: the train loss (trainer) and the lr (LR monitor); then the final evaluation.
    lrs = [f"lr/group{i}" for i in range(len(trainer.state.optimizer.param_groups))]
    assert [(r["step"], sorted(r["metrics"])) for r in metrics] == [
        (1, ["loss/train"]),
        (1, lrs),
        (2, ["loss/train"]),
        (2, lrs),
        (3, ["loss/train"]),
        (3, lrs),
        (3, ["eval/val/accuracy", "eval/val/loss", "eval/val/perplexity"]),
    ]
    assert metrics[-3]["metrics"]["loss/train"] == trainer.state.train_loss
    assert all(isinstance(r["time"], float) for r in records)


def test_lines_are_on_disk_while_training(tmp_path):
    class ReadBack(Callback):
        lines = []

        def batch_end(self, state, logger):
            self.lines.append(len((tmp_path / "metrics.jsonl").read_text().splitlines()))

    jsonl = JSONLLogger(flush_interval="2ba")
    make_trainer(tmp_path, n_batches=4, callbacks=[ReadBack()], loggers=[jsonl]).fit()
    # Hyperparameters at once; the loss lines every 2 batches (the logger writes at BATCH_END
    # after the callbacks, so batch 3 sees batches 1 and 2). The train loss stays on the device
    # until then: the lines are written, and the loss read, once per interval.
    assert ReadBack.lines == [1, 1, 3, 3]
    assert len(read(tmp_path / "metrics.jsonl")) == 5


def test_non_finite_values_are_null_and_lines_stay_strict_json(tmp_path):
    class LogOdd(Callback):
        def batch_end(self, state, logger):
            logger.log_metrics({"odd/nan": math.nan, "odd/inf": math.inf, "odd/one": 1})

    make_trainer(
        tmp_path, n_batches=1, callbacks=[LogOdd()], loggers=[JSONLLogger("logs/m.jsonl")]
    ).fit()
    text = (tmp_path / "logs" / "m.jsonl").read_text()
    assert "NaN" not in text and "Infinity" not in text
    assert read(tmp_path / "logs" / "m.jsonl")[-1]["metrics"] == {
        "odd/nan": None,
        "odd/inf": None,
        "odd/one": 1.0,
    }


def test_a_rerun_appends(tmp_path):
    for _ in range(2):
        make_trainer(tmp_path, n_batches=1, loggers=[JSONLLogger()]).fit()
    assert len(read(tmp_path / "metrics.jsonl")) == 4


def test_only_rank_zero_writes(tmp_path):
    class SecondRank(SingleDevice):
        rank = 1

    make_trainer(tmp_path, n_batches=1, strategy=SecondRank(), loggers=[JSONLLogger()]).fit()
    assert not (tmp_path / "metrics.jsonl").exists()

"""The trainer's model contract (llmfoundry/core/model.py): forward(batch), loss(outputs,
batch), eval_metrics(device); eval sets may bring their own metrics."""

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from llmfoundry.core.metrics import DeviceScalar
from llmfoundry.loggers import JSONLLogger
from llmfoundry.trainer import Callback, EvalSet, Trainer
from llmfoundry.utils.errors import UserError
from llmfoundry.utils.jsonl import read_jsonl

from .conftest import tiny_model, token_batches


class Bigram(nn.Module):
    """A user's own module: next-token logits from the current token alone."""

    def __init__(self, vocab: int = 64) -> None:
        super().__init__()
        self.table = nn.Embedding(vocab, vocab)

    def forward(self, batch):
        return self.table(batch["input_ids"])

    def loss(self, logits, batch):
        labels = batch["labels"][:, 1:]
        total = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels.flatten(), reduction="sum")
        return total / (labels != -100).sum().clamp(min=1)


class RowsSeen:
    """Counts the eval rows that count (sample_mask True) and those whose first token is even."""

    def __init__(self, device):
        self.totals = torch.zeros(2, dtype=torch.float64, device=device)

    def update(self, outputs, batch, sample_mask):
        even = (batch["input_ids"][:, 0] % 2 == 0) & sample_mask
        self.totals += torch.stack([sample_mask.sum(), even.sum()]).double()

    def compute(self):
        rows, even = self.totals.tolist()
        return {"rows": rows, "even": even}


def trainer(tmp_path, model, batches, **kwargs):
    return Trainer(
        model=model,
        train_dataloader=batches,
        max_duration=f"{len(batches)}ba",
        optimizer=functools.partial(torch.optim.Adam, lr=0.1),
        run_dir=tmp_path,
        **kwargs,
    )


def test_a_users_own_module_trains_and_each_eval_set_brings_its_metrics(tmp_path):
    class Outputs(Callback):
        seen = []

        def after_forward(self, state, logger):
            self.seen.append(tuple(state.outputs.shape))

    data = token_batches(2, 4, seed=2)
    masked = [{**b, "sample_mask": torch.tensor([True, True, True, False])} for b in data]
    run = trainer(
        tmp_path,
        Bigram(),
        data * 5,
        eval_dataloaders={"lm": data, "rows": EvalSet(masked, metrics=RowsSeen)},
        eval_first=True,
        callbacks=[Outputs()],
    )
    before = run.evaluate()["eval/lm/loss"]
    metrics = run.fit().eval_metrics
    assert metrics["eval/lm/loss"] < before - 1.0  # it learned the repeated batches
    assert set(metrics) == {
        "eval/lm/loss",
        "eval/lm/perplexity",
        "eval/lm/accuracy",
        "eval/rows/rows",
        "eval/rows/even",
    }
    assert metrics["eval/rows/rows"] == 6  # two batches of 4, one padding row each
    even = sum(int((b["input_ids"][:3, 0] % 2 == 0).sum()) for b in data)
    assert metrics["eval/rows/even"] == even
    assert Outputs.seen[0] == (4, 16, 64)


def test_a_models_eval_metrics_score_its_plain_loaders(tmp_path):
    class Scored(Bigram):
        eval_metrics = RowsSeen

    data = token_batches(1, 4)
    metrics = trainer(tmp_path, Scored(), data, eval_dataloaders={"v": data}).evaluate()
    assert metrics == {
        "eval/v/rows": 4.0,
        "eval/v/even": float((data[0]["input_ids"][:, 0] % 2 == 0).sum()),
    }


def test_a_models_train_metrics_are_logged_after_each_batch(tmp_path):
    """train_metrics() (an MoE's router losses, say) lands beside loss/train every batch, its
    DeviceScalars read when the logger writes."""

    class Measured(Bigram):
        def train_metrics(self):
            return {"train/table_norm": DeviceScalar(self.table.weight.detach().norm())}

    model = Measured()
    norms = []

    class Norms(Callback):
        def batch_end(self, state, logger):
            norms.append(float(model.table.weight.detach().norm()))

    run = trainer(
        tmp_path,
        model,
        token_batches(3, 2),
        callbacks=[Norms()],
        loggers=[JSONLLogger(flush_interval="3ba")],
    )
    run.fit()
    records = [r.get("metrics", {}) for _, r in read_jsonl(str(tmp_path / "metrics.jsonl"))]
    logged = [r["train/table_norm"] for r in records if "train/table_norm" in r]
    assert logged == pytest.approx(norms) and len(set(logged)) == 3
    assert all("loss/train" in r for r in records if "train/table_norm" in r)


def test_a_model_without_loss_is_refused(tmp_path):
    with pytest.raises(UserError, match=r"has no loss\(outputs, batch\)"):
        trainer(tmp_path, nn.Linear(2, 2), token_batches(1, 2))


def test_mpt_forward_takes_a_batch_as_well_as_input_ids():
    model = tiny_model()
    model.to_empty(device="cpu")
    model.init_weights()
    ids = token_batches(1, 2)[0]["input_ids"]
    sequence_id = torch.tensor([[0] * 8 + [1] * 8, [0] * 16])
    batch = {"input_ids": ids, "labels": ids, "sequence_id": sequence_id}
    logits = model(batch)
    assert torch.equal(logits, model(ids, sequence_id=sequence_id))
    assert not torch.equal(logits, model(ids))  # the batch's sequence_id was used
    assert torch.equal(model.loss(logits, batch), model.loss(logits, ids))
    with pytest.raises(ValueError, match="inside the batch"):
        model(batch, sequence_id=sequence_id)

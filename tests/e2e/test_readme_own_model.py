"""The README's "Your own model" adapter trains a Hugging Face Llama (built from a tiny config,
no hub) with the trainer, callbacks and a logger: on one device, and with DDP on two gloo
processes, where it equals one process on the whole batch."""

import json

import pytest
import torch

from llmfoundry.distributed import SingleDevice
from tests.distributed.spawn import free_port, run_ranks
from tests.distributed.workers import global_batches
from tests.trainer.conftest import token_batches

from .own_model import ddp_rank, readme_module, train


def test_readme_adapter_trains_a_hf_llama_and_evaluates_it(tmp_path):
    data = token_batches(4, 4, seed=1)
    trainer = train(
        tmp_path, SingleDevice("cpu"), data * 3, eval_dataloaders={"val": data}, eval_first=True
    )
    state = trainer.state
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    evals = [
        line["metrics"]["eval/val/loss"]
        for line in lines
        if "eval/val/loss" in line.get("metrics", {})
    ]
    assert len(evals) == 2 and evals[1] < evals[0]  # it learned the (repeated) batches
    assert {"throughput/tokens_per_sec", "lr/group0"} <= {
        key for line in lines for key in line.get("metrics", {})
    }
    # The eval loss is the adapter's own loss on the same batches.
    model = state.model
    with torch.no_grad():
        expected = sum(model.loss(model(b), b).item() for b in data) / len(data)
    assert state.eval_metrics["eval/val/loss"] == pytest.approx(expected, rel=1e-5)


def test_readme_adapter_ddp_two_ranks_equal_one_process(tmp_path):
    run_ranks(ddp_rank, 2, free_port(), str(tmp_path))
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    (tmp_path / "single").mkdir()
    reference = train(tmp_path / "single", SingleDevice("cpu"), global_batches()).state
    params = dict(reference.model.named_parameters())
    for result in results:
        for name, value in result["params"].items():
            torch.testing.assert_close(value, params[name].detach(), rtol=1e-5, atol=1e-6)
        assert result["train_loss"].item() == pytest.approx(reference.train_loss, rel=1e-6)


def test_readme_adapter_loss_is_zero_without_loss_tokens(tmp_path):
    model = readme_module(tmp_path).tiny_llama()
    batch = token_batches(1, 2)[0]
    batch["labels"][:] = -100
    assert model.loss(model(batch), batch).item() == 0.0

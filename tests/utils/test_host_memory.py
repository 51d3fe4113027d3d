"""Freed host memory is reused: CPU training steps stop page-faulting their large tensors in."""

from __future__ import annotations

import functools
import json
import subprocess
import sys

import pytest
import torch

from llmfoundry.optim import DecoupledAdamW
from llmfoundry.trainer import Trainer
from llmfoundry.trainer import trainer as trainer_module
from tests.trainer.conftest import tiny_model, token_batches

# In a fresh process (the setting is process-wide): the median page faults of three training steps
# of a small model whose logits (4 x 256 x 16384 float32, 64 MB: above the largest size glibc's
# own threshold ever serves from the heap, 32 MB) and their gradient are large blocks, after four
# warm-up steps (with reuse, a step now and then still grows the heap once).
_FAULTS_OF_TRAINING_STEPS = """
import json, resource, sys
import torch
from llmfoundry.models.mpt import MPTConfig, MPTForCausalLM
from llmfoundry.utils.host_memory import reuse_freed_host_memory
applied = reuse_freed_host_memory() if sys.argv[1] == "on" else None
torch.manual_seed(0)
model = MPTForCausalLM(MPTConfig(d_model=64, n_heads=2, n_layers=2, max_seq_len=256, vocab_size=16384))
optimizer = torch.optim.AdamW(model.parameters())
ids = torch.randint(0, 16384, (4, 256))
faults = []
for _ in range(7):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    model.loss(model(ids), ids).backward()
    optimizer.step()
    optimizer.zero_grad()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"applied": applied, "faults": sorted(faults[4:])[1]}))
"""


def _faults(mode: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _FAULTS_OF_TRAINING_STEPS, mode],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_training_steps_reuse_freed_memory_instead_of_faulting_it_in_again():
    logits_pages = (4 * 256 * 16384 * 4) // 4096
    off, on = _faults("off"), _faults("on")
    assert off["faults"] > logits_pages // 2  # the default: the logits mapped anew every step
    assert on["applied"] is True
    assert on["faults"] < logits_pages // 4


def test_the_trainer_applies_it_when_training_on_the_cpu(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(trainer_module, "reuse_freed_host_memory", lambda: calls.append(1))
    trainer = Trainer(
        model=tiny_model(),
        train_dataloader=token_batches(1, 2),
        max_duration="1ba",
        optimizer=functools.partial(DecoupledAdamW, lr=1e-3),
        run_dir=tmp_path,
    )
    assert trainer.state.device == torch.device("cpu")
    assert calls == [1]

"""Shared by the checkpoint tests and by the training subprocesses they start.

Samples carry their own id in their first two tokens (``id // VOCAB``, ``id % VOCAB``), so a
step's sample ids can be read back from its labels (which algorithms never change).
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import time
from pathlib import Path

import numpy as np
import torch

from llmfoundry.data.mds import MDSWriter
from llmfoundry.models.mpt import MPTForCausalLM
from llmfoundry.trainer import Callback

from ..trainer.conftest import tiny_model

VOCAB = 64
SEQ_LEN = 16


def write_mds(root: Path, samples: dict[str, int], seed: int = 0) -> Path:
    """An MDS dataset with one folder per split; ids are unique across splits."""
    rng = np.random.default_rng(seed)
    first = 0
    for split, count in samples.items():
        with MDSWriter(root / split, {"tokens": f"ndarray:uint16:{SEQ_LEN}"}, size_limit=800) as w:
            for i in range(first, first + count):
                tokens = rng.integers(0, VOCAB, SEQ_LEN).astype(np.uint16)
                tokens[:2] = divmod(i, VOCAB)
                w.write({"tokens": tokens})
        first += count
    return root


class Batches(list):
    """One rank's in-memory batches with the data-position contract of llmfoundry.data
    (positions count samples of all `world` ranks)."""

    def __init__(self, batches, world: int = 1) -> None:
        super().__init__(batches)
        self.world = world
        self.skip = 0

    def state_dict(self, num_samples: int) -> dict:
        return {"sample_in_epoch": num_samples}

    def load_state_dict(self, state: dict) -> None:
        self.skip = state["sample_in_epoch"] // (len(self[0]["input_ids"]) * self.world)

    def __iter__(self):
        skip, self.skip = self.skip, 0  # only the resumed epoch starts part-way
        return itertools.islice(super().__iter__(), skip, None)


def sample_ids(batch: dict[str, torch.Tensor]) -> list[int]:
    labels = batch["labels"]
    return (labels[:, 0] * VOCAB + labels[:, 1]).tolist()


def model(dropout: float = 0.1) -> MPTForCausalLM:
    """Tiny MPT with dropout, so an unrestored torch RNG changes the losses.

    Built on meta, so the trainer initializes it from its seed.
    """
    return tiny_model(VOCAB, SEQ_LEN, resid_pdrop=dropout, emb_pdrop=dropout)


# Set in a training subprocess's environment to interrupt it, e.g. "SIGKILL@8" or "SIGTERM@4",
# so every launch of a run is the same command line.
INTERRUPT_ENV = "LLMFOUNDRY_TEST_INTERRUPT"


class StepRecorder(Callback):
    """Records each step's loss (exactly, as float.hex) and sample ids; optionally as JSONL.

    In a training subprocess, `INTERRUPT_ENV` interrupts the run at the end of a batch:
    ``SIGKILL@<batch>`` kills the process (a crash: nothing saved at that batch);
    ``SIGTERM@<batch>`` writes ``<path>.at`` and waits (up to 60 s) for ``<path>.sent``, which
    the test creates after sending the process SIGTERM, so the signal lands mid-run.
    """

    def __init__(self, path: str | None = None) -> None:
        self.path = path
        self.steps: list[dict] = []
        self._ids: list[int] = []
        kind, _, batch = os.environ.get(INTERRUPT_ENV, "@").partition("@")
        self.interrupt = (kind, int(batch)) if kind else None

    def after_dataloader(self, state, logger) -> None:
        self._ids = sample_ids(state.batch)

    def batch_end(self, state, logger) -> None:
        step = {
            "batch": state.timestamp.batch,
            "loss": float(state.train_loss).hex(),
            "ids": self._ids,
        }
        self.steps.append(step)
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps(step) + "\n")
        if self.interrupt is None or self.interrupt[1] != state.timestamp.batch:
            return
        if self.interrupt[0] == "SIGKILL":
            os.kill(os.getpid(), signal.SIGKILL)
        Path(f"{self.path}.at").write_text(str(state.timestamp.batch))
        deadline = time.monotonic() + 60
        while not Path(f"{self.path}.sent").exists() and time.monotonic() < deadline:
            time.sleep(0.01)


def read_steps(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

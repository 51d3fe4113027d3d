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
from llmfoundry.models.mpt import MPTConfig, MPTForCausalLM
from llmfoundry.trainer import Callback

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
    """In-memory batches with the dataloader's data-position contract (llmfoundry.data)."""

    def __init__(self, batches) -> None:
        super().__init__(batches)
        self.skip = 0

    def state_dict(self, num_samples: int) -> dict:
        return {"sample_in_epoch": num_samples}

    def load_state_dict(self, state: dict) -> None:
        self.skip = state["sample_in_epoch"] // len(self[0]["input_ids"])

    def __iter__(self):
        skip, self.skip = self.skip, 0  # only the resumed epoch starts part-way
        return itertools.islice(super().__iter__(), skip, None)


def sample_ids(batch: dict[str, torch.Tensor]) -> list[int]:
    labels = batch["labels"]
    return (labels[:, 0] * VOCAB + labels[:, 1]).tolist()


def model(dropout: float = 0.1) -> MPTForCausalLM:
    """Tiny MPT with dropout, so an unrestored torch RNG changes the losses."""
    config = MPTConfig(
        d_model=32, n_heads=2, n_layers=2, max_seq_len=SEQ_LEN, vocab_size=VOCAB,
        resid_pdrop=dropout, emb_pdrop=dropout,
    )
    with torch.device("meta"):
        return MPTForCausalLM(config)


class StepRecorder(Callback):
    """Records each step's loss (exactly, as float.hex) and sample ids; optionally as JSONL.

    For the subprocess tests it can also interrupt its own run after batch `kill_at`:
    ``kill_with="SIGKILL"`` kills the process at BATCH_END (a crash: nothing saved at that
    batch); ``kill_with="wait"`` writes `<path>.at` and waits (up to 30 s) for the test to send a
    signal, then lets the batch finish.
    """

    def __init__(
        self, path: str | None = None, kill_at: int | None = None, kill_with: str = "SIGKILL"
    ) -> None:
        self.path = path
        self.kill_at = kill_at
        self.kill_with = kill_with
        self.steps: list[dict] = []
        self._ids: list[int] = []

    def after_dataloader(self, state, logger) -> None:
        self._ids = sample_ids(state.batch)

    def batch_end(self, state, logger) -> None:
        step = {"batch": state.timestamp.batch, "loss": float(state.train_loss).hex(), "ids": self._ids}
        self.steps.append(step)
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps(step) + "\n")
        if state.timestamp.batch != self.kill_at:
            return
        if self.kill_with == "SIGKILL":
            os.kill(os.getpid(), signal.SIGKILL)
        Path(f"{self.path}.at").write_text(str(state.timestamp.batch))
        deadline = time.monotonic() + 30
        while not Path(f"{self.path}.sent").exists() and time.monotonic() < deadline:
            time.sleep(0.01)


def read_steps(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

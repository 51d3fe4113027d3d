"""Checks before the first batch: the data's vocabulary and row length against the model, and the
opt-in per-batch token id check."""

from __future__ import annotations

import functools
import json
import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from llmfoundry.build import build_trainer
from llmfoundry.callbacks import TokenIdCheck
from llmfoundry.config.preflight import compose_config
from llmfoundry.data.mds import MDSWriter
from llmfoundry.trainer import Trainer
from tests.trainer.conftest import tiny_model, token_batches

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "conf"
TINY = [
    "model.d_model=32", "model.n_heads=2", "model.n_layers=2", "model.max_seq_len=16",
    "model.vocab_size=64", "global_train_batch_size=4", "max_duration=1ba", "eval_first=false",
    "callbacks=[]", "loggers=[]", "save_folder=null", "tokenizer=null",
]  # fmt: skip


def dataset(root: Path, row_len: int = 16, vocab_size: int | None = 64) -> Path:
    """A data_prep-shaped folder: split folders of token rows, and meta.json when vocab_size."""
    for split, rows in (("train", 8), ("val", 4)):
        with MDSWriter(root / split, {"tokens": f"ndarray:uint16:{row_len}"}) as writer:
            for i in range(rows):
                writer.write({"tokens": (np.arange(row_len) * (i + 1) % 60).astype(np.uint16)})
    if vocab_size is not None:
        (root / "meta.json").write_text(json.dumps({"vocab_size": vocab_size, "seq_len": row_len}))
    return root


def test_data_vocabulary_larger_than_the_model_is_refused_at_startup(tmp_path):
    root = dataset(tmp_path / "mds", vocab_size=100)
    cfg = compose_config(CONF, [*TINY, f"data.remote={root}"])
    with pytest.raises(
        ValueError,
        match=r"model.vocab_size=64 is smaller than the data's vocabulary \(100 in .*meta.json\).*set model.vocab_size=100",
    ):
        build_trainer(cfg, tmp_path / "run")


def test_eval_set_vocabulary_larger_than_the_model_is_refused_at_startup(tmp_path, caplog):
    main = dataset(tmp_path / "mds", vocab_size=50)
    code = dataset(tmp_path / "code", vocab_size=100)
    overrides = [*TINY, f"data.remote={main}"]
    with pytest.raises(ValueError, match=r"smaller than the data's vocabulary \(100 in .*code"):
        build_trainer(
            compose_config(CONF, [*overrides, f"data.eval_datasets={{code: '{code}'}}"]),
            tmp_path / "run",
        )
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="llmfoundry"):
        build_trainer(compose_config(CONF, overrides), tmp_path / "run2")
    assert caplog.text.count("is larger than the data's vocabulary") == 1  # val shares train's


@pytest.mark.slow
def test_cli_names_both_vocabularies_before_training(tmp_path):
    root = dataset(tmp_path / "mds", vocab_size=100)
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts/train.py"), *TINY, f"data.remote={root}",
         f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode != 0
    assert "model.vocab_size=64 is smaller than the data's vocabulary (100" in result.stderr
    assert "loss/train" not in result.stdout + result.stderr  # nothing trained


def test_model_vocabulary_larger_than_the_data_warns(tmp_path, caplog):
    root = dataset(tmp_path / "mds", vocab_size=50)
    with caplog.at_level(logging.WARNING, logger="llmfoundry"):
        build_trainer(compose_config(CONF, [*TINY, f"data.remote={root}"]), tmp_path / "run")
    assert "model.vocab_size=64 is larger than the data's vocabulary (50" in caplog.text
    assert "14 embedding rows are never trained" in caplog.text
    # The same on every rank: said by rank 0 only (llmfoundry/utils/logs.py).
    assert all(getattr(r, "same_on_every_rank", False) for r in caplog.records if "vocab" in r.msg)


def test_rows_longer_than_max_seq_len_warn_with_the_numbers(tmp_path, caplog):
    root = dataset(tmp_path / "mds", row_len=64)
    with caplog.at_level(logging.WARNING, logger="llmfoundry"):
        build_trainer(compose_config(CONF, [*TINY, f"data.remote={root}"]), tmp_path / "run")
    lines = [r.getMessage() for r in caplog.records if "max_seq_len=16" in r.getMessage()]
    assert len(lines) == 2  # once for each dataset (train, val), not per shard or batch
    assert "hold 64 tokens but max_seq_len=16: the last 48 tokens of every row are cut" in lines[0]
    assert "--seq-len 16" in lines[0]
    cut = [r for r in caplog.records if "max_seq_len=16" in r.getMessage()]
    assert all(getattr(r, "same_on_every_rank", False) for r in cut)  # said by rank 0 only


def test_rows_that_fit_do_not_warn(tmp_path, caplog):
    root = dataset(tmp_path / "mds", row_len=16)
    with caplog.at_level(logging.WARNING, logger="llmfoundry"):
        build_trainer(compose_config(CONF, [*TINY, f"data.remote={root}"]), tmp_path / "run")
    assert "cut" not in caplog.text and "vocab" not in caplog.text


def test_token_id_check_names_the_batch_and_the_id(tmp_path):
    batches = token_batches(3, 2, vocab=64)
    batches[1]["input_ids"][0, 3] = 70
    trainer = Trainer(
        model=tiny_model(vocab_size=64),
        train_dataloader=batches,
        max_duration="3ba",
        optimizer=functools.partial(torch.optim.SGD, lr=0.1),
        run_dir=tmp_path,
        callbacks=[TokenIdCheck(vocab_size=64)],
    )
    with pytest.raises(
        ValueError,
        match=r"training batch 2 \(epoch 0\) holds token id 70, outside the model's vocabulary \[0, 64\)",
    ):
        trainer.fit()
    assert trainer.state.timestamp.batch == 1  # refused before the bad batch's step


def test_token_id_check_config_follows_the_model(tmp_path):
    cfg = compose_config(CONF, [*TINY, "callbacks=[token_id_check]", "model.vocab_size=128"])
    assert cfg.callbacks.token_id_check.vocab_size == 128

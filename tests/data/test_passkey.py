"""The passkey task: its rows, its MDS dataset, its score, and scripts/eval_passkey.py."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from llmfoundry.checkpoint.catalogue import MODEL_FILE, STATE_FILE
from llmfoundry.checkpoint.pretrained import load_pretrained
from llmfoundry.checkpoint.state_dict import model_weights
from llmfoundry.checkpoint.writer import write_checkpoint, write_object, write_tensors
from llmfoundry.data.passkey import PasskeyTask, read_task, score_passkey, write_passkey_dataset
from llmfoundry.data.streaming import StreamingDataLoader
from llmfoundry.data.text import StreamingTextDataset
from llmfoundry.models import MPTConfig, MPTForCausalLM

ROOT = Path(__file__).resolve().parents[2]


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_rows_hide_the_key_once_and_end_with_query_and_answer():
    task = PasskeyTask(seq_len=50, n_digits=2, n_filler=8)
    rows, key_pos = task.rows(200, seed=0)
    assert rows.shape == (200, 50) and rows.dtype == np.uint16
    for row, pos in zip(rows, key_pos, strict=True):
        digits = np.flatnonzero((row >= 2) & (row <= 11))
        assert digits.tolist() == [pos, pos + 1, 48, 49]  # the key, then the answer
        assert row[task.query_pos] == 1 and (row[pos : pos + 2] == row[48:]).all()
        filler = np.delete(row, [pos, pos + 1, 47, 48, 49])
        assert ((filler >= 12) & (filler < 20)).all()
    assert key_pos.min() == 0 and key_pos.max() == task.query_pos - 2  # every depth is drawn
    assert np.array_equal(task.rows(5, seed=3)[0], task.rows(5, seed=3)[0])


def test_too_short_rows_are_refused():
    with pytest.raises(ValueError, match="seq_len >= 11"):
        PasskeyTask(seq_len=10, n_digits=3)


def test_dataset_reads_back_through_the_loader(tmp_path):
    task = PasskeyTask(seq_len=24)
    write_passkey_dataset(tmp_path, task, train_rows=30, val_rows=10, seed=5)
    assert read_task(tmp_path) == task
    loader = StreamingDataLoader(StreamingTextDataset(str(tmp_path), split="val", batch_size=4))
    loader.set_epoch(0)
    rows = torch.cat([b["input_ids"] for b in loader])
    assert torch.equal(rows, torch.from_numpy(task.rows(10, seed=6)[0].astype(np.int64)))
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    words = tok.decode(rows[0].tolist()).split()
    assert words[task.query_pos] == "<query>" and len(words) == 24


def test_score_counts_exact_matches_per_depth():
    task = PasskeyTask(seq_len=40, n_digits=2)
    rows = torch.from_numpy(task.rows(300, seed=1)[0].astype(np.int64))
    key_pos = ((rows >= 2) & (rows <= 11)).int().argmax(1)
    depth = (task.query_pos - key_pos) // 8

    def oracle(ids):  # predicts each next token correctly
        logits = torch.zeros(*ids.shape, 40)
        logits[:, :-1].scatter_(2, ids[:, 1:, None], 1.0)
        return logits

    scores = score_passkey(oracle, rows, task, window=8, batch_size=64)
    assert sorted(scores) == sorted(depth.unique().tolist())
    assert all(c == t == int((depth == d).sum()) for d, (c, t) in scores.items())

    def first_digit_only(ids):  # the first answer digit right, the second always "0"
        logits = oracle(ids)
        logits[:, task.query_pos + 1] = 0
        logits[:, task.query_pos + 1, 2] = 1
        return logits

    scores = score_passkey(first_digit_only, rows, task, window=8)
    lucky = rows[:, -1] == 2
    assert sum(c for c, _ in scores.values()) == int(lucky.sum())


def test_eval_script_scores_a_checkpoint(tmp_path, capsys):
    task = PasskeyTask(seq_len=32, n_digits=1)
    write_passkey_dataset(tmp_path / "data", task, train_rows=4, val_rows=40)
    model_cfg = {
        "_target_": "llmfoundry.models.mpt.MPTConfig",
        "d_model": 32,
        "n_heads": 4,
        "n_layers": 1,
        "vocab_size": len(task.vocab),
        "max_seq_len": 32,
        "infini": {"segment_len": 8},
    }
    torch.manual_seed(0)
    model = MPTForCausalLM(MPTConfig(**{k: v for k, v in model_cfg.items() if k[0] != "_"}))
    files = {
        MODEL_FILE: write_tensors(model_weights(model.state_dict())),
        STATE_FILE: write_object({"config": {"model": model_cfg}}),
    }
    write_checkpoint(str(tmp_path / "ckpt"), "ep0-ba1", files)
    loaded, _ = load_pretrained(str(tmp_path / "ckpt"))
    ids = torch.randint(0, len(task.vocab), (2, 32))
    torch.testing.assert_close(loaded(ids), model(ids), rtol=0, atol=0)

    out = tmp_path / "scores.json"
    argv = [str(tmp_path / "ckpt"), "--data", str(tmp_path / "data"), "--json", str(out)]
    assert _script("scripts/eval_passkey.py").main(argv) == 0
    result = json.loads(out.read_text())
    assert result["window"] == 8
    assert sum(d["rows"] for d in result["depths"].values()) == 40
    rows = torch.from_numpy(task.rows(40, seed=1)[0].astype(np.int64))
    expected = score_passkey(model, rows, task, window=8)
    assert {int(d): (v["correct"], v["rows"]) for d, v in result["depths"].items()} == expected
    assert "beyond one window" in capsys.readouterr().out


def test_data_prep_cli_writes_the_dataset(tmp_path, capsys):
    argv = ["--out", str(tmp_path), "--seq-len", "20", "--train-rows", "3", "--val-rows", "2"]
    assert _script("data_prep/passkey.py").main(argv) == 0
    assert json.loads(capsys.readouterr().out)["seq_len"] == 20
    assert read_task(tmp_path) == PasskeyTask(seq_len=20)

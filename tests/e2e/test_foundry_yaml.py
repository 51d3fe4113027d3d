"""End to end: an llm-foundry train YAML (their schema, a tiny MPT) trains through
`scripts/train.py their.yaml key=value` on MDS shards made by our data_prep, on the CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from llmfoundry.data.prep.text_to_tokens import text_to_tokens
from llmfoundry.data.prep.tokens_to_mds import tokens_to_mds

from ..config.test_foundry import FOUNDRY_YAML

ROOT = Path(__file__).resolve().parents[2]


def make_mds(folder: Path) -> Path:
    """data_prep's shards (train and val, 32-token rows) and tokenizer.json in `folder`."""
    corpus = folder / "corpus"
    corpus.mkdir()
    for i, path in enumerate(sorted((ROOT / "llmfoundry" / "config").glob("*.py"))):
        (corpus / f"doc{i}.txt").write_text(path.read_text())
    tokens = folder / "tokens.bin"
    text_to_tokens([str(corpus)], tokens, train_tokenizer=True, vocab_size=300, progress=False)
    tokens_to_mds(tokens, str(folder / "my-mds"), 32, val_rows=8, progress=False)
    return folder / "my-mds"


def test_their_yaml_trains_here_end_to_end(tmp_path):
    make_mds(tmp_path)
    (tmp_path / "their.yaml").write_text(FOUNDRY_YAML)
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts/train.py"), "their.yaml",
         "variables.run_name=from-foundry", "model.n_layers=1"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    run = tmp_path / "outputs" / "from-foundry"
    lines = (run / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line).get("metrics", {}) for line in lines]
    losses = [row["loss/train"] for row in rows if "loss/train" in row]
    assert len(losses) == 4  # max_duration: 4ba
    assert any("eval/val/loss" in row for row in rows)  # eval_loader: split val, every 2ba
    # save_folder ./ckpt/{run_name}, one checkpoint kept
    saved = (tmp_path / "ckpt" / "from-foundry").iterdir()
    assert sorted(p.name for p in saved if not p.name.startswith(".")) == [
        "ep0-ba4",
        "latest",
    ]
    config = (run / ".hydra" / "config.yaml").read_text()
    assert "n_layers: 1" in config and "learned_pos_emb: true" in config
    assert "llm-foundry fsdp_config: one process trains without FSDP" in result.stderr

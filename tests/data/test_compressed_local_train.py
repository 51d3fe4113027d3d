"""The README's recipe with compression (issue 14.4): `tokens_to_mds.py --compression zstd`, then
`scripts/train.py data.remote=<that local folder>` trains and evaluates, eval sets included, with
no cache folder given: shards are decompressed into a cache under the temp dir."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # runs scripts in subprocesses; `make test-fast` skips it

ROOT = Path(__file__).resolve().parents[2]


def run(*args: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=300, env=env
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def _files(root: Path) -> list[str]:
    return sorted(str(p) for name in ("mds", "code") for p in (root / name).rglob("*"))


def test_compressed_local_dataset_trains_and_evaluates(tmp_path):
    temp = tmp_path / "systemp"
    temp.mkdir()
    env = {**os.environ, "TMPDIR": str(temp), "PYTHONPATH": str(ROOT)}
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, path in enumerate(sorted((ROOT / "llmfoundry" / "data").rglob("*.py"))[:12]):
        (corpus / f"doc{i}.txt").write_text(path.read_text())
    tokens = tmp_path / "tok" / "tokens.bin"
    run(
        str(ROOT / "data_prep/text_to_tokens.py"),
        str(corpus),
        "--train-tokenizer",
        "--vocab-size=300",
        f"--out={tokens}",
        "--no-progress",
        cwd=tmp_path,
        env=env,
    )
    for name in ("mds", "code"):
        run(
            str(ROOT / "data_prep/tokens_to_mds.py"),
            str(tokens),
            "--seq-len=16",
            "--val-rows=8",
            "--size-limit=2kb",
            "--compression=zstd",
            f"--out={tmp_path / name}",
            "--no-progress",
            cwd=tmp_path,
            env=env,
        )
    before = _files(tmp_path)
    result = run(
        str(ROOT / "scripts/train.py"),
        f"data.remote={tmp_path / 'mds'}",
        f"data.eval_datasets={{code: {tmp_path / 'code'}}}",
        "model.d_model=16",
        "model.n_heads=2",
        "model.n_layers=1",
        "model.max_seq_len=16",
        "model.vocab_size=320",
        "global_train_batch_size=4",
        "max_duration=2ba",
        "eval_interval=2ba",
        "scheduler.t_warmup=1ba",
        "callbacks=[]",
        "loggers=[console]",
        f"hydra.run.dir={tmp_path / 'run'}",
        f"save_folder={tmp_path / 'ckpt'}",
        cwd=tmp_path,
        env=env,
    )
    out = result.stdout + result.stderr
    assert re.search(r"eval/val/loss", out) and re.search(r"eval/code/loss", out), out
    assert _files(tmp_path) == before  # data folders untouched
    assert len(list(temp.rglob("shard.*.mds"))) > 2  # decompressed under the temp dir

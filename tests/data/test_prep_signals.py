"""SIGTERM / SIGINT to the data_prep scripts (issue 13.9): workers stop, no partial output stays.

Each test starts the real script in a subprocess, waits until it is busy (workers running, or
shards being written), sends the signal and checks what is left, bounded by timeouts.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from llmfoundry.data.mds import load_index
from llmfoundry.data.prep import train_bpe
from llmfoundry.data.prep.text_to_tokens import TOKENS_FORMAT

psutil = pytest.importorskip("psutil")
pytestmark = pytest.mark.slow  # runs scripts in subprocesses; `make test-fast` skips it

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 60


def start(*args: str, cwd: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, *args], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )


def wait_for(condition, proc: subprocess.Popen, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not condition():
        if proc.poll() is not None:
            pytest.fail(f"{what}: the script ended first: {proc.communicate()}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"{what}: timed out")
        time.sleep(0.05)


def alive(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


@pytest.fixture(scope="module")
def big_corpus(tmp_path_factory) -> tuple[Path, Path]:
    """~24 MB of text in 48 files, and a tokenizer for it (tokenizing takes seconds)."""
    root = tmp_path_factory.mktemp("bigcorpus")
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "sigma", "omega", "x1", "(y)", "z\n"]
    for i in range(48):
        text = " ".join(rng.choice(words, 90_000))
        (root / "corpus").mkdir(exist_ok=True)
        (root / "corpus" / f"f{i:02d}.txt").write_text(text)
    tok = train_bpe([" ".join(words)] * 10, 300)
    tok.save(str(root / "tokenizer.json"))
    return root / "corpus", root / "tokenizer.json"


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_text_to_tokens_stops_its_workers_and_cleans_up(big_corpus, tmp_path, signum):
    corpus, tokenizer = big_corpus
    out = tmp_path / "out"
    proc = start(
        str(ROOT / "data_prep/text_to_tokens.py"),
        str(corpus),
        f"--tokenizer={tokenizer}",
        f"--out={out / 'tokens.bin'}",
        "--workers=2",
        "--no-progress",
        cwd=tmp_path,
    )
    parent = psutil.Process(proc.pid)
    wait_for(
        lambda: len(parent.children()) >= 2 and list(out.glob("tokens.bin.tmp.*")),
        proc,
        "workers start",
    )
    workers = [c.pid for c in parent.children(recursive=True)]
    time.sleep(0.3)
    proc.send_signal(signum)
    try:
        proc.wait(TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("the script did not stop")
    deadline = time.monotonic() + 10
    while alive(workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = alive(workers)
    for pid in left:
        psutil.Process(pid).kill()
    assert not left, "worker processes survived the script"
    assert proc.returncode != 0
    assert sorted(p.name for p in out.iterdir()) == ["tokenizer.json"]  # no partial token files
    assert "interrupted" in proc.stderr.read().decode()


def test_tokens_to_mds_never_leaves_shards_without_an_index(tmp_path):
    # a token stream made directly: 3M tokens -> ~375k rows of 8 tokens, many small shards
    tokens = tmp_path / "tokens.bin"
    (np.arange(3_000_000) % 257).astype(np.uint16).tofile(tokens)  # ids of a 257-token BPE
    train_bpe(["a b"], 257).save(str(tmp_path / "tokenizer.json"))
    sidecar = {
        "format": TOKENS_FORMAT, "version": 1, "tokens_file": "tokens.bin", "dtype": "uint16",
        "num_tokens": 3_000_000, "tokenizer": "tokenizer.json", "vocab_size": 257,
        "eos_id": 0, "bos_id": None, "fingerprint": "x",
    }  # fmt: skip
    (tmp_path / "tokens.json").write_text(json.dumps(sidecar))
    out = tmp_path / "mds"
    proc = start(
        str(ROOT / "data_prep/tokens_to_mds.py"),
        str(tokens),
        f"--out={out}",
        "--seq-len=8",
        "--size-limit=16kb",
        "--no-progress",
        cwd=tmp_path,
    )
    wait_for(lambda: len(list(out.glob("train/shard.*"))) >= 3, proc, "shards appear")
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("the script did not stop")
    assert proc.returncode != 0, "killed too late: the script had finished"
    assert not list(out.rglob("*.tmp.*"))
    for folder in {p.parent for p in out.rglob("shard.*")}:
        listed = {s.stored.basename for s in load_index(folder)}  # an index exists...
        assert {p.name for p in folder.glob("shard.*")} == listed  # ...and lists every shard

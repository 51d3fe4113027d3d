"""Long documents are tokenized in pieces with the whole document's tokens (issue 13.10)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, normalizers

from llmfoundry.data.prep import open_tokens, text_to_tokens, train_bpe
from llmfoundry.data.prep.chunking import chunking_is_exact, split_document
from llmfoundry.tokenizers.tokenizer import prepare

ROOT = Path(__file__).resolve().parents[2]


def document(n_words: int, seed: int = 0) -> str:
    rng = np.random.default_rng(seed)
    words = ["alpha", "Beta", "gämma", "δέλτα", "x1", "42", "(y)", "it's", "漢字", "<|endoftext|>"]
    seps = [" ", " ", " ", "  ", "\n", "\n\n", "\t", " \n ", ", ", "\r\n", "   "]
    parts = [rng.choice(words) + rng.choice(seps) for _ in range(n_words)]
    return " lead" + "".join(parts) + "   "


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    tok = train_bpe([document(3000, seed=1)], 400)
    tok.encode_special_tokens = True
    return tok


def test_pieces_are_bounded_and_rejoin(tokenizer):
    text = document(2000)
    pieces = list(split_document(text, 50))
    assert "".join(pieces) == text and len(pieces) > 100
    for piece in pieces[1:]:  # every cut is just before a space that starts a word
        assert piece[0] == " " and not piece[1].isspace()
    for piece in pieces:  # longer only when no such space was within reach
        starts = [i for i in range(1, len(piece) - 1) if piece[i] == " " and piece[i + 1] > " "]
        assert len(piece) <= 50 or not [i for i in starts if i <= 50]
    assert sum(len(p) <= 50 for p in pieces) > 0.9 * len(pieces)
    assert list(split_document("x" * 100, 10)) == ["x" * 100]  # no word start: one piece


@pytest.mark.parametrize("workers", [1, 2])
def test_chunked_tokens_equal_whole_document_tokens(tokenizer, tmp_path, workers):
    text = document(6000)  # ~40k characters, cut into pieces of at most 1000
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "big.txt").write_text(text)
    (tmp_path / "docs" / "small.txt").write_text("tiny doc")
    tokenizer.save(str(tmp_path / "tok.json"))
    text_to_tokens(
        [str(tmp_path / "docs")],
        tmp_path / "out" / "t.bin",
        tokenizer=tmp_path / "tok.json",
        chunk_chars=1000,
        workers=workers,
        progress=False,
    )
    tokens, meta = open_tokens(tmp_path / "out" / "t.bin")
    eos = meta["eos_id"]
    want = [
        *tokenizer.encode(text, add_special_tokens=False).ids,
        eos,
        *tokenizer.encode("tiny doc", add_special_tokens=False).ids,
        eos,
    ]
    assert np.asarray(tokens).tolist() == want


def test_a_tokenizer_that_chunking_would_change_encodes_whole_documents(tokenizer, tmp_path):
    tok = Tokenizer.from_str(tokenizer.to_str())
    tok.normalizer = normalizers.Prepend("▁")  # added to every call's input: pieces would differ
    assert chunking_is_exact(prepare(Tokenizer.from_str(tokenizer.to_str())).encode_pieces)
    assert not chunking_is_exact(prepare(tok).encode_pieces)
    tok.save(str(tmp_path / "tok.json"))
    (tmp_path / "docs").mkdir()
    text = document(500)
    (tmp_path / "docs" / "d.txt").write_text(text)
    text_to_tokens(
        [str(tmp_path / "docs")],
        tmp_path / "t.bin",
        tokenizer=tmp_path / "tok.json",
        chunk_chars=100,
        progress=False,
    )
    tokens, meta = open_tokens(tmp_path / "t.bin")
    tok.encode_special_tokens = True
    assert np.asarray(tokens)[:-1].tolist() == tok.encode(text, add_special_tokens=False).ids


def varied_text(n_chars: int) -> str:
    """Text of many distinct words (a few repeated words would hit the tokenizer's cache)."""
    rng = np.random.default_rng(2)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    words = ["".join(rng.choice(letters, rng.integers(2, 9))) for _ in range(3000)]
    seps = [" "] * 20 + ["\n", ", ", ". ", "\n\n", "  ", "\t"]
    ids, sep_ids = rng.integers(0, 3000, n_chars // 5), rng.integers(0, len(seps), n_chars // 5)
    return "".join(words[i] + seps[j] for i, j in zip(ids, sep_ids, strict=True))


MEASURE = """
import json, resource, sys
from pathlib import Path
from llmfoundry.data.prep import text_to_tokens
tmp = Path(sys.argv[1])
text_to_tokens([str(tmp / "docs")], tmp / "t.bin", tokenizer=tmp / "tok.json",
               chunk_chars=int(sys.argv[2]) or None, progress=False)  # warm up: imports, pools
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
(tmp / "docs" / "big.txt").write_text(Path(sys.argv[3]).read_text())
text_to_tokens([str(tmp / "docs")], tmp / "t.bin", tokenizer=tmp / "tok.json",
               chunk_chars=int(sys.argv[2]) or None, progress=False, overwrite=True)
print(json.dumps((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024))
"""


@pytest.mark.slow
def test_memory_does_not_grow_with_document_size(tokenizer, tmp_path):
    """A 3.7 MB document: peak memory grows by ~50 MB, not the ~900 MB of a whole-document call."""
    tokenizer.save(str(tmp_path / "tok.json"))
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "big.txt").write_text(document(200))
    big = tmp_path / "big-source.txt"
    big.write_text(varied_text(3_000_000))
    result = subprocess.run(
        [sys.executable, "-c", MEASURE, str(tmp_path), str(1 << 18), str(big)],
        capture_output=True,
        text=True,
        timeout=300,
        env={"PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false", "PATH": ""},
    )
    assert result.returncode == 0, result.stderr
    grown_mb = json.loads(result.stdout.strip().splitlines()[-1])
    assert grown_mb < 300, f"peak memory grew by {grown_mb:.0f} MB for a 3 MB document"

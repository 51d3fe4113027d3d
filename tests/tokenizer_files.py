"""Tiny SentencePiece and tiktoken tokenizer files, made in a test in well under a second."""

from __future__ import annotations

import base64
import io
from pathlib import Path

TEXT = "\n".join(
    f"the quick brown fox {i} jumps over the lazy dog; hello world number {i}" for i in range(200)
)


def tiny_sentencepiece(folder: Path, vocab_size: int = 320) -> Path:
    """A byte-fallback BPE SentencePiece model of `vocab_size` pieces (EOS ``</s>``, id 2)."""
    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(TEXT.splitlines()),
        model_writer=model,
        vocab_size=vocab_size,
        model_type="bpe",
        byte_fallback=True,
        minloglevel=2,
    )
    path = folder / "tiny.model"
    path.write_bytes(model.getvalue())
    return path


def tiny_tiktoken(folder: Path) -> Path:
    """A tiktoken rank file: the 256 bytes, then a few merges (``<|endoftext|>`` becomes the
    id after them)."""
    tokens = [bytes([b]) for b in range(256)]
    tokens += [b"th", b"he", b"the", b" t", b" the", b"ll", b"lo", b"llo", b"hello"]
    lines = [f"{base64.b64encode(t).decode()} {rank}" for rank, t in enumerate(tokens)]
    path = folder / "tiny.tiktoken"
    path.write_text("\n".join(lines) + "\n")
    return path

"""Tokenizers: load one from a spec (`prepare_tokenizer`), or train a byte-level BPE.

Data prep works on a ``tokenizers.Tokenizer`` (the fast Rust library): it serialises to one
JSON string, so worker processes rebuild it cheaply, and a byte-level BPE decodes back to
exactly the input text, which is what makes the round trip testable. `PreparedTokenizer` is the
implementation of the tokenizer protocol (`llmfoundry.core.tokenizer.Tokenizer`) that
generation, evaluation and serving take, beside the SentencePiece and tiktoken ones of
foreign.py.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from llmfoundry.tokenizers.foreign import (
    TIKTOKEN_PREFIX,
    SentencePieceTokenizer,
    TiktokenTokenizer,
    is_foreign_spec,
)
from llmfoundry.utils import storage
from llmfoundry.utils.errors import MissingInput, UserError
from llmfoundry.utils.files import atomic_write

__all__ = [
    "DataPrepTokenizer",
    "EOS_TOKEN",
    "PreparedTokenizer",
    "load_tokenizer",
    "prepare",
    "prepare_tokenizer",
    "token_byte_lengths",
    "train_bpe",
]

EOS_TOKEN = "<|endoftext|>"


@dataclass(frozen=True)
class PreparedTokenizer:
    """A tokenizer plus the ids data prep needs; `llmfoundry.core.tokenizer.Tokenizer` (made by
    `prepare`, which has special-token text encode as plain text). `eos_id` is None only when
    prepared with ``require_eos=False`` (generation and evaluation, which need no EOS)."""

    tokenizer: Tokenizer
    eos_id: int | None
    bos_id: int | None
    eos_token: str | None
    bos_token: str | None

    @property
    def vocab_size(self) -> int:
        """One more than the largest id the tokenizer can produce."""
        vocab = self.tokenizer.get_vocab(with_added_tokens=True)
        return max(self.tokenizer.get_vocab_size(with_added_tokens=True), max(vocab.values()) + 1)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """`encode` of each text. The Rust tokenizer releases the GIL here and not in `encode`,
        so a server tokenizing in a worker thread keeps answering."""
        return [encoding.ids for encoding in self.tokenizer.encode_batch(list(texts))]

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids))

    def encode_pieces(self, texts: Sequence[str]) -> list[list[int]]:
        """The ids of each text without what the tokenizer adds around every input: data prep
        adds its own BOS and EOS around documents."""
        encodings = self.tokenizer.encode_batch(list(texts), add_special_tokens=False)
        return [encoding.ids for encoding in encodings]

    def token_byte_lengths(self) -> np.ndarray | None:
        return token_byte_lengths(self.tokenizer)

    file_name = "tokenizer.json"  # what data prep saves it as, next to what it writes

    @property
    def json(self) -> str:
        return self.tokenizer.to_str()

    @property
    def file_data(self) -> bytes:
        return self.json.encode("utf-8")

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.file_data).hexdigest()

    def save(self, path: str | os.PathLike) -> Path:
        """Write tokenizer.json atomically."""
        atomic_write(path, self.json)
        return Path(path)


# What `prepare_tokenizer` gives: each has the protocol plus data prep's `encode_pieces`,
# `eos_token`/`bos_token`, `sha256`, `file_name`, `file_data` and `save`.
DataPrepTokenizer = PreparedTokenizer | SentencePieceTokenizer | TiktokenTokenizer


def train_bpe(texts: Iterable[str], vocab_size: int, min_frequency: int = 2) -> Tokenizer:
    """Train a GPT-2 style byte-level BPE with ``<|endoftext|>`` as its only special token.

    Byte level means every string is representable (no unknown token) and decoding is exact.
    """
    if vocab_size < 257 or vocab_size > (1 << 32):
        raise UserError(f"--vocab-size must be at least 257 (256 bytes + EOS), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def token_byte_lengths(tok: Tokenizer) -> np.ndarray | None:
    """The UTF-8 bytes of decoded text each token id stands for (0 for special tokens such as
    EOS), indexed by id; None when decoding is not a sum over tokens.

    Exact for a byte-level BPE (a ``ByteLevel`` decoder, as :func:`train_bpe` makes): every
    character of a vocabulary entry is one byte, so the bytes of any token sequence decoded with
    ``skip_special_tokens`` are the sum of its tokens' lengths, even for a sequence cut inside a
    multi-byte character. Other tokenizers (SentencePiece's spaces, byte fallback) decode a
    sequence to something else than its tokens' pieces joined, so they get None, not a guess.
    """
    if not isinstance(tok.decoder, decoders.ByteLevel):
        return None
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    added = tok.get_added_tokens_decoder()
    vocab = tok.get_vocab(with_added_tokens=True)
    lengths = np.zeros(max(vocab.values(), default=-1) + 1, np.int64)
    for token, token_id in vocab.items():
        if token_id in added:
            special = added[token_id].special
            lengths[token_id] = 0 if special else len(tok.decode([token_id]).encode("utf-8"))
        elif set(token) <= alphabet:
            lengths[token_id] = len(token)
        else:
            return None  # not a byte-level vocabulary after all
    return lengths


def _token_id(tok: Tokenizer, token: str, flag: str) -> int:
    token_id = tok.token_to_id(token)
    if token_id is None:
        raise UserError(f"token {token!r} is not in the tokenizer's vocabulary; fix {flag}")
    return token_id


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """The tokenizer at ``path``: a tokenizer.json file or URL, or a folder holding one, or a
    transformers tokenizer folder (fast tokenizers only). Used by data prep and by training.
    """
    url = os.fspath(path)
    if not storage.is_local(url):
        try:
            with storage.open_url(url, "r", encoding="utf-8") as f:
                return _parse(f.read(), url)
        except FileNotFoundError:
            raise MissingInput(f"tokenizer {url} not found") from None
    path = Path(storage.local_path(url))
    if path.is_dir() and (path / "tokenizer.json").is_file():
        path = path / "tokenizer.json"
    if path.is_file():
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            text = ""  # not JSON either: _parse says so
        return _parse(text, str(path))
    if path.is_dir():
        from transformers import AutoTokenizer

        _refuse_remote_code(path)
        hf = AutoTokenizer.from_pretrained(
            str(path), local_files_only=True, trust_remote_code=False
        )
        if not getattr(hf, "is_fast", False):
            raise UserError(
                f"{path} holds a slow (Python) tokenizer; a fast one is needed "
                "(a folder with tokenizer.json)"
            )
        return hf.backend_tokenizer
    raise MissingInput(
        f"tokenizer {path} not found; give a tokenizer.json file or a tokenizer folder"
    )


MAX_TOKENIZER_CONFIG_BYTES = 1 << 20  # real ones are a few KB


def _refuse_remote_code(folder: Path) -> None:
    """A tokenizer folder whose tokenizer is its own code (tokenizer_config.json's `auto_map`,
    as llm-foundry's tiktoken wrapper writes) is refused: transformers would otherwise ask, on
    a terminal, whether to run that code. Its config is read as bounded JSON."""
    config = folder / "tokenizer_config.json"
    if not config.is_file() or config.stat().st_size > MAX_TOKENIZER_CONFIG_BYTES:
        return  # none, or transformers says what is wrong with it
    try:
        auto_map = json.loads(config.read_bytes()).get("auto_map")
    except (OSError, ValueError, AttributeError):
        return
    if auto_map:
        raise UserError(
            f"{config}: the tokenizer is code of the folder's own (auto_map {auto_map}), which "
            "llmfoundry never runs; give a tokenizer.json, or for a tiktoken encoding "
            "tiktoken:NAME (e.g. tiktoken:cl100k_base) or a .tiktoken rank file"
        )


def _parse(text: str, source: str) -> Tokenizer:
    """A tokenizer from tokenizer.json text; a file that is not one is a one-line ValueError."""
    try:
        return Tokenizer.from_str(text)
    except Exception as err:  # the Rust library raises plain Exception
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise UserError(
            f"{source} is not a valid tokenizer.json ({reason}); give a file saved by "
            "tokenizers' Tokenizer.save or a transformers fast tokenizer folder"
        ) from None


def prepare_tokenizer(
    path: str | os.PathLike,
    eos_token: str | None = None,
    bos_token: str | None = None,
    *,
    require_eos: bool = True,
) -> DataPrepTokenizer:
    """The tokenizer `path` selects, with the EOS/BOS ids data prep needs: the one loader of
    generation, evaluation, serving and data prep.

    `path` is a SentencePiece ``.model`` file, a tiktoken ``.tiktoken`` file or
    ``tiktoken:NAME`` (see foreign.py), or else what :func:`load_tokenizer` reads
    (a tokenizer.json or transformers folder; see :func:`prepare`). The EOS token defaults to
    ``<|endoftext|>`` when the vocabulary has it, else to the ``eos_token`` a transformers
    folder's tokenizer_config.json names (the model's own ``</s>`` for SentencePiece).
    """
    spec = os.fspath(path)
    if is_foreign_spec(spec):
        kind = (
            TiktokenTokenizer
            if spec.endswith(".tiktoken") or spec.startswith(TIKTOKEN_PREFIX)
            else SentencePieceTokenizer
        )
        foreign = kind(spec, eos_token, bos_token)
        if foreign.eos_id is None and require_eos:
            raise UserError(f"the tokenizer {spec} has no EOS token; name one with --eos-token")
        return foreign
    default_eos = _configured_eos(Path(path))
    return prepare(load_tokenizer(path), eos_token, bos_token, default_eos, require_eos)


def _configured_eos(folder: Path) -> str | None:
    """The eos_token a transformers tokenizer folder configures, if any."""
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        config = folder / name
        if folder.is_dir() and config.is_file():
            eos = json.loads(config.read_text(encoding="utf-8")).get("eos_token")
            if isinstance(eos, dict):
                eos = eos.get("content")
            if isinstance(eos, str):
                return eos
    return None


def prepare(
    tok: Tokenizer,
    eos_token: str | None = None,
    bos_token: str | None = None,
    default_eos: str | None = None,
    require_eos: bool = True,
) -> PreparedTokenizer:
    """Resolve EOS/BOS ids and make special-token text in documents encode as plain text.

    Without ``encode_special_tokens`` a document containing the literal text
    ``<|endoftext|>`` would get a real EOS id in the middle, silently splitting it. A tokenizer
    without an EOS is refused unless ``require_eos`` is false (its `eos_id` is then None).
    """
    tok.encode_special_tokens = True
    if eos_token is None:
        eos_token = EOS_TOKEN if tok.token_to_id(EOS_TOKEN) is not None else default_eos
    if eos_token is None and not require_eos:
        bos_id = _token_id(tok, bos_token, "--bos-token") if bos_token is not None else None
        return PreparedTokenizer(tok, None, bos_id, None, bos_token)
    if eos_token is None:
        raise UserError(
            f"the tokenizer has no {EOS_TOKEN!r} token and no eos_token; name one with --eos-token"
        )
    eos_id = _token_id(tok, eos_token, "--eos-token")
    bos_id = _token_id(tok, bos_token, "--bos-token") if bos_token is not None else None
    return PreparedTokenizer(tok, eos_id, bos_id, eos_token, bos_token)

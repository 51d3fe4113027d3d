"""SentencePiece and tiktoken tokenizers, as implementations of `llmfoundry.core.tokenizer`.

Users of Llama-style (SentencePiece ``.model``) and OpenAI-style (tiktoken BPE rank files)
tokenizers have no tokenizer.json; these adapters give generation, evaluation and serving the
same protocol `PreparedTokenizer` gives them, so one spec selects a tokenizer everywhere
(`llmfoundry.tokenizers.tokenizer.prepare_tokenizer`):

- ``PATH.model``: a SentencePiece model (a protobuf: parsing it runs no code);
- ``PATH.tiktoken``: a tiktoken BPE rank file (lines of ``base64(token bytes) rank``);
- ``tiktoken:NAME`` (``tiktoken:cl100k_base``): one of tiktoken's encodings, from its cache
  only (``TIKTOKEN_CACHE_DIR``), never downloaded: a training job must not fetch its tokenizer
  from the internet halfway through a launch, nor hang where there is no network.

Both libraries are imported only when such a tokenizer is asked for (``pip install tiktoken
sentencepiece``). Special-token text in a document (``<|endoftext|>``, ``</s>``) encodes as
plain text, as `prepare` makes the `tokenizers` one do.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import importlib
import os
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from llmfoundry.utils import storage
from llmfoundry.utils.errors import MissingInput, MissingPackage, UserError
from llmfoundry.utils.files import atomic_write

__all__ = ["TIKTOKEN_PREFIX", "SentencePieceTokenizer", "TiktokenTokenizer", "is_foreign_spec"]

TIKTOKEN_PREFIX = "tiktoken:"
EOS_TOKEN = "<|endoftext|>"
# A tokenizer file is read whole; o200k_base's rank file is 3.6 MB, Gemma's SentencePiece 4 MB.
MAX_TOKENIZER_BYTES = 256 << 20


def is_foreign_spec(spec: str) -> bool:
    """Whether `spec` names a SentencePiece or tiktoken tokenizer (else: `tokenizers`)."""
    return spec.startswith(TIKTOKEN_PREFIX) or spec.endswith((".model", ".tiktoken"))


def _require(module: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingPackage(
            f"this tokenizer needs the {module} package; install it: pip install {module}"
        ) from None


def _read(spec: str) -> bytes:
    try:
        return storage.read_small(spec, MAX_TOKENIZER_BYTES)
    except FileNotFoundError:
        raise MissingInput(f"tokenizer {spec} not found") from None


def _special_id(specials: dict[str, int], token: str, flag: str) -> int:
    if token not in specials:
        raise UserError(
            f"token {token!r} is not a special token of the tokenizer ({', '.join(specials)}); "
            f"fix {flag}"
        )
    return specials[token]


class _TokenizerFile:
    """What data prep asks of a tokenizer besides the protocol: its file, to save next to the
    tokens it wrote and to fingerprint them with."""

    file_data: bytes
    file_name: str

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.file_data).hexdigest()

    def save(self, path: str | os.PathLike) -> Path:
        atomic_write(path, self.file_data)
        return Path(path)


class SentencePieceTokenizer(_TokenizerFile):
    """A SentencePiece model. EOS is the model's own (``</s>``) unless `eos_token` names another
    piece; BOS is set only when `bos_token` names one (data prep then starts documents with
    it). `encode` adds nothing around the text, as `encode_batch` does not either."""

    def __init__(self, spec: str, eos_token: str | None = None, bos_token: str | None = None):
        spm = _require("sentencepiece")
        self.spec = spec
        self.model = spm.SentencePieceProcessor()
        self.file_data = _read(spec)
        try:
            self.model.LoadFromSerializedProto(self.file_data)
        except RuntimeError as err:
            reason = str(err).splitlines()[0]
            raise UserError(
                f"{spec} is not a SentencePiece model ({reason}); give the .model file "
                "spm_train wrote"
            ) from None
        own_eos = self.model.eos_id()
        self.eos_token = eos_token or (self.model.id_to_piece(own_eos) if own_eos >= 0 else None)
        self.eos_id = self._piece_id(eos_token, "--eos-token") if eos_token else None
        if eos_token is None and own_eos >= 0:
            self.eos_id = own_eos
        self.bos_token = bos_token
        self.bos_id = self._piece_id(bos_token, "--bos-token") if bos_token else None

    file_name = "tokenizer.model"  # what data prep saves it as, next to what it writes

    def _piece_id(self, piece: str, flag: str) -> int:
        piece_id = self.model.piece_to_id(piece)
        if self.model.id_to_piece(piece_id) != piece:  # unknown pieces map to <unk>
            raise UserError(f"token {piece!r} is not in the tokenizer's vocabulary; fix {flag}")
        return piece_id

    @property
    def vocab_size(self) -> int:
        return self.model.get_piece_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.model.encode(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self.model.encode(list(texts)) if texts else []

    encode_pieces = encode_batch  # data prep's: nothing is added around a text

    def decode(self, ids: Sequence[int]) -> str:
        """The text of `ids`; ids past the vocabulary (a model's padded embedding rows) and
        control pieces (BOS, EOS) are left out."""
        return self.model.decode([i for i in ids if 0 <= i < self.vocab_size])

    def token_byte_lengths(self) -> None:
        return None  # "▁" pieces decode to spaces, byte-fallback pieces to parts of characters


_TIKTOKEN_LOCK = threading.Lock()


@contextlib.contextmanager
def _tiktoken_offline(local: dict[str, bytes]) -> Iterator[None]:
    """tiktoken reads files through `tiktoken.load.read_file` when they are not in its cache;
    here it reads `local` (URL -> bytes) instead and never the network. tiktoken has no
    offline switch, so the function is swapped for the call (under a lock: it is global)."""
    tiktoken_load = importlib.import_module("tiktoken.load")

    def read_file(blobpath: str) -> bytes:
        if blobpath in local:
            return local[blobpath]
        cache = os.environ.get("TIKTOKEN_CACHE_DIR", "<tmp>/data-gym-cache")
        raise MissingInput(
            f"{blobpath} is not in tiktoken's cache (TIKTOKEN_CACHE_DIR={cache}) and is not "
            "downloaded here; load the encoding once where there is network with the same "
            "TIKTOKEN_CACHE_DIR, or give the local .tiktoken file"
        )

    with _TIKTOKEN_LOCK:
        original = tiktoken_load.read_file
        tiktoken_load.read_file = read_file
        try:
            yield
        finally:
            tiktoken_load.read_file = original


def _parse_ranks(data: bytes, spec: str) -> dict[bytes, int]:
    """A tiktoken rank file: one ``base64(token bytes) rank`` line per token."""
    ranks = {}
    for number, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except (ValueError, binascii.Error):
            raise UserError(
                f"{spec} line {number} is not 'base64-token rank'; give a tiktoken BPE rank "
                "file (.tiktoken)"
            ) from None
    if not ranks:
        raise UserError(f"{spec} holds no tokens; give a tiktoken BPE rank file (.tiktoken)")
    return ranks


def _dump_ranks(ranks: dict[bytes, int]) -> bytes:
    """`ranks` as a tiktoken rank file (what `_parse_ranks` reads)."""
    lines = (
        f"{base64.b64encode(t).decode()} {r}\n"
        for t, r in sorted(ranks.items(), key=lambda x: x[1])
    )
    return "".join(lines).encode()


class TiktokenTokenizer(_TokenizerFile):
    """A tiktoken encoding: ``tiktoken:NAME`` from tiktoken's cache, or a local ``.tiktoken``
    file. A file named after one of tiktoken's encodings (``cl100k_base.tiktoken``) gets that
    encoding's split pattern and special tokens (and its checksum); another gets GPT-2's
    pattern and ``<|endoftext|>`` after its last token. EOS is ``<|endoftext|>`` unless
    `eos_token` names another special token; BOS only when `bos_token` names one."""

    def __init__(self, spec: str, eos_token: str | None = None, bos_token: str | None = None):
        tiktoken = _require("tiktoken")
        self.spec = spec
        if spec.startswith(TIKTOKEN_PREFIX):
            name = spec.removeprefix(TIKTOKEN_PREFIX)
            self.encoding = self._by_name(tiktoken, name, {})
            ranks = {
                t: self.encoding.encode_single_token(t) for t in self.encoding.token_byte_values()
            }
            data = _dump_ranks(ranks)
        else:
            data = _read(spec)
            name = Path(storage.local_path(spec) if storage.is_local(spec) else spec).stem
            if name in tiktoken.list_encoding_names() and name != "gpt2":  # gpt2: 2 files
                url = f"https://openaipublic.blob.core.windows.net/encodings/{name}.tiktoken"
                self.encoding = self._by_name(tiktoken, name, {url: data})
            else:
                ranks = _parse_ranks(data, spec)
                pattern = importlib.import_module("tiktoken_ext.openai_public").r50k_pat_str
                eos = {EOS_TOKEN: max(ranks.values()) + 1}
                self.encoding = tiktoken.Encoding(name, pat_str=pattern, mergeable_ranks=ranks,
                                                  special_tokens=eos)  # fmt: skip
        specials = {
            t: self.encoding.encode_single_token(t) for t in self.encoding.special_tokens_set
        }
        self.eos_token = eos_token or (EOS_TOKEN if EOS_TOKEN in specials else None)
        self.eos_id = (
            _special_id(specials, self.eos_token, "--eos-token") if self.eos_token else None
        )
        self.bos_token = bos_token
        self.bos_id = _special_id(specials, bos_token, "--bos-token") if bos_token else None
        self._special_ids = frozenset(specials.values())
        self.file_data = data
        # Saved under the encoding's name, a rank file loads again as that encoding (gpt2's as
        # GPT-2's pattern and EOS after the ranks: what it is).
        self.file_name = f"{name}.tiktoken"

    @staticmethod
    def _by_name(tiktoken: Any, name: str, local: dict[str, bytes]) -> Any:
        if name not in tiktoken.list_encoding_names():
            raise UserError(
                f"tiktoken has no encoding {name!r} (it has {', '.join(tiktoken.list_encoding_names())});"
                " fix the tokenizer spec, or give a .tiktoken file"
            )
        with _tiktoken_offline(local):
            try:
                return tiktoken.get_encoding(name)
            except UserError:  # not cached: said by read_file above
                raise
            except ValueError as err:  # a checksum mismatch
                raise UserError(f"tiktoken encoding {name}: {err}") from None

    @property
    def vocab_size(self) -> int:
        return self.encoding.n_vocab

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.encoding.encode_ordinary(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self.encoding.encode_ordinary_batch(list(texts))

    encode_pieces = encode_batch  # data prep's: nothing is added around a text

    def decode(self, ids: Sequence[int]) -> str:
        """The text of `ids`, special tokens and ids outside the vocabulary left out."""
        keep = [i for i in ids if 0 <= i < self.vocab_size and i not in self._special_ids]
        return self.encoding.decode(keep, errors="replace")

    def token_byte_lengths(self) -> np.ndarray:
        """Byte-level: a token's bytes are its rank file entry (0 for special tokens and for the
        unused ids between the ranks and the special tokens)."""
        lengths = np.zeros(self.vocab_size, np.int64)
        for token_id in range(self.vocab_size):
            if token_id not in self._special_ids:
                with contextlib.suppress(KeyError):
                    lengths[token_id] = len(self.encoding.decode_single_token_bytes(token_id))
        return lengths

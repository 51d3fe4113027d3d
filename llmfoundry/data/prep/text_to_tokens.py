"""Text corpus -> one token stream on disk (numpy memmap ``.bin`` + JSON sidecar).

Documents are tokenized in order, each followed by EOS (and preceded by BOS if set), and
appended to ``<name>.bin`` (uint16 when the vocabulary fits, else uint32). ``<name>.json``
describes the stream and is written last, so its presence means the ``.bin`` is complete.
With ``doc_boundaries`` a parallel ``<name>.docs.bin`` (int64) holds each document's start
offset, from which per-document sequence ids follow.

Work is split into small tasks (see sources.py) tokenized by a process pool with a bounded
window of tasks in flight: memory stays bounded, and results are consumed in task order, so
the output is byte-identical whatever the number of workers.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import logging
import multiprocessing
import os
import signal
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer
from tqdm import tqdm

from llmfoundry.data.prep.chunking import chunking_is_exact, split_document
from llmfoundry.data.prep.reuse import is_reusable, settings_fingerprint
from llmfoundry.data.prep.sources import Task, fingerprint, plan_tasks, read_task
from llmfoundry.tokenizers.tokenizer import (
    DataPrepTokenizer,
    PreparedTokenizer,
    prepare,
    prepare_tokenizer,
    train_bpe,
)
from llmfoundry.utils.errors import MissingInput, OutputExists, UserError
from llmfoundry.utils.files import atomic_path, atomic_write

__all__ = ["TOKENS_FORMAT", "open_doc_index", "open_tokens", "sidecar_path", "text_to_tokens"]

TOKENS_FORMAT = "llmfoundry.tokens"
# Characters per tokenizer call: bounds a worker's memory (a few hundred MB) for any document.
CHUNK_CHARS = 1 << 20

log = logging.getLogger(__name__)


def sidecar_path(tokens_path: str | os.PathLike) -> Path:
    """``x.bin`` -> ``x.json``."""
    return Path(tokens_path).with_suffix(".json")


def _docs_path(tokens_path: Path) -> Path:
    return tokens_path.with_suffix(".docs.bin")


@dataclass(frozen=True)
class _Encoded:
    tokens: np.ndarray  # the task's documents, each with BOS/EOS, concatenated
    doc_tokens: np.ndarray  # int64 token count of each document
    doc_bytes: np.ndarray  # int64 UTF-8 byte count of each document's text
    skipped: int


# Worker state, set once per process by _init_worker (or in-process for one worker).
_STATE: dict[str, Any] = {}


def _init_worker(
    tokenizer: str | DataPrepTokenizer,
    eos_id: int,
    bos_id: int | None,
    dtype: str,
    chunk_chars: int | None,
) -> None:
    """`tokenizer`: tokenizer.json text (a `tokenizers` one is rebuilt from it, cheaper than
    pickling it) or a SentencePiece/tiktoken tokenizer."""
    if isinstance(tokenizer, str):
        tokenizer = prepare(Tokenizer.from_str(tokenizer), require_eos=False)
    _STATE.update(
        tokenizer=tokenizer, eos=eos_id, bos=bos_id, dtype=np.dtype(dtype), chunk_chars=chunk_chars
    )


def _init_pool_worker(*init_args: Any) -> None:
    # Ctrl-C reaches the whole process group; the parent stops the workers itself (below), so
    # they ignore it instead of each printing a KeyboardInterrupt traceback. SIGTERM (the
    # parent's terminate()) must kill a worker, whatever handler it inherited through fork.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _init_worker(*init_args)


def _encode_task(task: Task) -> _Encoded:
    docs, skipped = read_task(task)
    nonempty = [d for d in docs if d]
    skipped += len(docs) - len(nonempty)
    tok: DataPrepTokenizer = _STATE["tokenizer"]
    dtype, chunk = _STATE["dtype"], _STATE["chunk_chars"]
    head = np.array([] if _STATE["bos"] is None else [_STATE["bos"]], dtype)
    tail = np.array([_STATE["eos"]], dtype)
    # Long documents are encoded in pieces (chunking.py), and each tokenizer call gets at most
    # about chunk_chars characters, so a worker's memory does not grow with document size.
    pieces = (
        (d, piece)
        for d, text in enumerate(nonempty)
        for piece in (split_document(text, chunk) if chunk else (text,))
    )
    doc_tokens = np.full(len(nonempty), len(head) + 1, np.int64)
    parts: list[np.ndarray] = []
    previous = -1
    for group in _batches(pieces, chunk):
        encodings = tok.encode_pieces([piece for _, piece in group])
        for (d, _), ids in zip(group, encodings, strict=True):
            if d != previous:
                parts += [tail, head] if previous >= 0 else [head]
                previous = d
            parts.append(np.asarray(ids, dtype))
            doc_tokens[d] += len(ids)
    if previous >= 0:
        parts.append(tail)
    tokens = np.concatenate(parts) if parts else np.zeros(0, dtype)
    doc_bytes = np.fromiter(
        (len(d.encode("utf-8")) for d in nonempty), np.int64, count=len(nonempty)
    )
    return _Encoded(tokens, doc_tokens, doc_bytes, skipped)


def _batches(
    pieces: Iterable[tuple[int, str]], max_chars: int | None
) -> Iterator[list[tuple[int, str]]]:
    """Consecutive groups of pieces of at most ``max_chars`` characters (one piece at least)."""
    group: list[tuple[int, str]] = []
    size = 0
    for item in pieces:
        if group and max_chars is not None and size + len(item[1]) > max_chars:
            yield group
            group, size = [], 0
        group.append(item)
        size += len(item[1])
    if group:
        yield group


def _ordered_map(
    fn: Callable[[Task], _Encoded], tasks: Sequence[Task], workers: int, init_args: tuple
) -> Iterator[_Encoded]:
    """``map(fn, tasks)`` over ``workers`` processes, in order, at most 2*workers in flight.

    If the consumer stops early (an error, SIGTERM/SIGINT as raised by ``stop_on_signals``, or
    closing the generator), the workers are terminated at once rather than left to finish (or
    orphaned, still holding their memory).
    """
    if workers <= 1:
        _init_worker(*init_args)
        yield from map(fn, tasks)
        return
    # fork is cheap and needs no re-import; the tokenizer is rebuilt in each worker. Rust
    # thread pools must not be inherited across fork, so parallelism inside workers is off
    # (the processes are the parallelism).
    methods = multiprocessing.get_all_start_methods()
    ctx = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
    saved = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    others = set(multiprocessing.active_children())  # children that are not our workers
    pool = ProcessPoolExecutor(
        workers, mp_context=ctx, initializer=_init_pool_worker, initargs=init_args
    )
    try:
        todo = iter(tasks)
        pending = deque(pool.submit(fn, t) for t in itertools.islice(todo, 2 * workers))
        while pending:
            result = pending.popleft().result()
            nxt = next(todo, None)
            if nxt is not None:
                pending.append(pool.submit(fn, nxt))
            yield result
        pool.shutdown(wait=True)
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        workers_left = set(multiprocessing.active_children()) - others
        for process in workers_left:
            process.terminate()
        for process in workers_left:
            process.join(10)
            if process.is_alive():
                process.kill()
        raise
    finally:
        if saved is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = saved


def _capped(texts: Iterable[str], max_bytes: int | None) -> Iterator[str]:
    """Documents until (and including) the one that reaches ``max_bytes`` of UTF-8 text."""
    total = 0
    for text in texts:
        if max_bytes is not None and total >= max_bytes:
            return
        total += len(text.encode("utf-8"))
        yield text


def _training_texts(tasks: Sequence[Task], max_bytes: int | None) -> Iterator[str]:
    docs = (d for t in tasks for d in read_task(t)[0] if d)
    return _capped(docs, max_bytes)


def _write_stream(
    tasks: Sequence[Task],
    workers: int,
    init: tuple,
    max_bytes: int | None,
    tmp_tokens: Path,
    tmp_docs: Path,
    progress: bool,
) -> dict[str, int]:
    """Tokenize ``tasks`` in order, appending tokens and document starts; return the counts."""
    counts = {"tokens": 0, "documents": 0, "skipped": 0, "bytes": 0}
    bar = tqdm(total=len(tasks), desc="tokenizing", unit="task", disable=not progress)
    encoded = contextlib.closing(_ordered_map(_encode_task, tasks, workers, init))
    with open(tmp_tokens, "wb") as f_tok, open(tmp_docs, "wb") as f_docs, encoded as results:
        for enc in results:
            n_docs = len(enc.doc_tokens)
            if max_bytes is not None:  # keep documents until the one that reaches the cap
                before = counts["bytes"] + np.concatenate([[0], np.cumsum(enc.doc_bytes)[:-1]])
                n_docs = int(np.count_nonzero(before < max_bytes))
            n_tok = int(enc.doc_tokens[:n_docs].sum())
            f_tok.write(enc.tokens[:n_tok].tobytes())
            starts = counts["tokens"] + np.concatenate([[0], np.cumsum(enc.doc_tokens[:n_docs])])
            f_docs.write(starts[:-1].astype(np.int64).tobytes())
            counts["tokens"] += n_tok
            counts["documents"] += n_docs
            counts["bytes"] += int(enc.doc_bytes[:n_docs].sum())
            counts["skipped"] += enc.skipped
            bar.update(1)
            bar.set_postfix(docs=counts["documents"], tokens=counts["tokens"])
            if max_bytes is not None and counts["bytes"] >= max_bytes:
                break
    bar.close()
    return counts


def _check_existing(tokens_path: Path, key: str, overwrite: bool) -> dict | None:
    """The sidecar of an up-to-date previous run with the same inputs, else None."""
    sidecar = sidecar_path(tokens_path)
    if overwrite or not sidecar.exists():
        return None
    try:
        meta = open_tokens(tokens_path)[1]
    except (ValueError, FileNotFoundError) as err:
        raise OutputExists(
            f"{tokens_path} exists but is unusable ({err}); pass --overwrite to redo it"
        ) from None
    if not is_reusable(meta, key, overwrite, str(tokens_path)):
        return None
    tok_file = sidecar.parent / meta["tokenizer"]
    if not tok_file.is_file() or _sha256(tok_file) != meta["tokenizer_sha256"]:
        raise OutputExists(
            f"{tok_file} is missing or no longer the tokenizer {tokens_path} was made with; "
            "pass --overwrite to redo it"
        )
    return meta


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def text_to_tokens(
    sources: Sequence[str],
    out: str | os.PathLike,
    *,
    tokenizer: str | os.PathLike | None = None,
    train_tokenizer: bool = False,
    vocab_size: int = 8192,
    train_bytes: int | None = 256 << 20,
    globs: Sequence[str] = ("*.txt",),
    excludes: Sequence[str] = (),
    text_field: str = "text",
    hf_split: str = "train",
    hf_config: str | None = None,
    max_bytes: int | None = None,
    eos_token: str | None = None,
    bos_token: str | None = None,
    doc_boundaries: bool = False,
    workers: int = 1,
    overwrite: bool = False,
    progress: bool = True,
    chunk_chars: int | None = CHUNK_CHARS,
) -> dict[str, Any]:
    """Tokenize ``sources`` into ``out`` (a ``.bin`` path); return the sidecar metadata.

    Exactly one of ``tokenizer`` (a tokenizer.json or tokenizer folder) and
    ``train_tokenizer`` (train a byte-level BPE of ``vocab_size`` on the first
    ``train_bytes`` of text) must be given. The tokenizer is saved as ``tokenizer.json`` next
    to ``out``. A rerun with the same inputs and settings returns at once with
    ``meta["reused"] = True``. ``chunk_chars`` caps the characters per tokenizer call (long
    documents are cut at word starts, giving the same tokens; see chunking.py); None encodes
    every document whole.
    """
    out = Path(out)
    _check_arguments(out, tokenizer, train_tokenizer, workers, max_bytes)
    tasks = plan_tasks(sources, globs, excludes, text_field, hf_split, hf_config)

    loaded = prepare_tokenizer(tokenizer, eos_token, bos_token) if tokenizer is not None else None
    settings = {
        "inputs": fingerprint(tasks),
        "tokenizer": loaded.sha256 if loaded else ["train_bpe", vocab_size, train_bytes],
        "max_bytes": max_bytes,
        "eos_token": eos_token,
        "bos_token": bos_token,
        "doc_boundaries": doc_boundaries,
        "version": 1,
    }
    key = settings_fingerprint(settings)
    previous = _check_existing(out, key, overwrite)
    if previous is not None:
        return {**previous, "reused": True}

    if loaded is None:
        texts = _training_texts(tasks, min(filter(None, (train_bytes, max_bytes)), default=None))
        loaded = prepare(train_bpe(texts, vocab_size), eos_token, bos_token)
    tok_path = _place_tokenizer(loaded, tokenizer, out.parent / loaded.file_name, overwrite)
    dtype = np.dtype(np.uint16 if loaded.vocab_size <= (1 << 16) else np.uint32)

    sidecar_path(out).unlink(missing_ok=True)  # no sidecar until the new .bin is complete
    init = (
        loaded.json if isinstance(loaded, PreparedTokenizer) else loaded,
        loaded.eos_id,
        loaded.bos_id,
        dtype.name,
        _exact_chunking(loaded, chunk_chars),
    )
    with atomic_path(out) as tmp_tokens, atomic_path(_docs_path(out)) as tmp_docs:
        counts = _write_stream(tasks, workers, init, max_bytes, tmp_tokens, tmp_docs, progress)
        if counts["tokens"] == 0:
            raise UserError(
                f"sources {list(sources)} produced no documents (all empty or unreadable)"
            )
    if not doc_boundaries:
        _docs_path(out).unlink()

    meta = {
        "format": TOKENS_FORMAT,
        "version": 1,
        "tokens_file": out.name,
        "dtype": dtype.name,
        "num_tokens": counts["tokens"],
        "num_documents": counts["documents"],
        "skipped_documents": counts["skipped"],
        "text_bytes": counts["bytes"],
        "doc_index": _docs_path(out).name if doc_boundaries else None,
        "doc_index_dtype": "int64",
        "tokenizer": tok_path.name,
        "tokenizer_sha256": _sha256(tok_path),
        "vocab_size": loaded.vocab_size,
        "eos_id": loaded.eos_id,
        "eos_token": loaded.eos_token,
        "bos_id": loaded.bos_id,
        "bos_token": loaded.bos_token,
        "sources": [str(s) for s in sources],
        "fingerprint": key,
    }
    atomic_write(sidecar_path(out), json.dumps(meta, indent=2, sort_keys=True) + "\n")
    return {**meta, "reused": False}


def _check_arguments(
    out: Path,
    tokenizer: str | os.PathLike | None,
    train_tokenizer: bool,
    workers: int,
    max_bytes: int | None,
) -> None:
    if out.suffix != ".bin":
        raise UserError(f"output {out} must end in .bin (the sidecar goes to {out.stem}.json)")
    if (tokenizer is None) == (not train_tokenizer):
        raise UserError("give exactly one of --tokenizer PATH and --train-tokenizer")
    if workers < 1:
        raise UserError(f"--workers must be at least 1, got {workers}")
    if max_bytes is not None and max_bytes <= 0:
        raise UserError(f"--max-bytes must be positive, got {max_bytes}")


def _place_tokenizer(
    loaded: DataPrepTokenizer,
    given: str | os.PathLike | None,
    tok_path: Path,
    overwrite: bool,
) -> Path:
    """Save the tokenizer as ``tok_path`` (next to the output), where the token stream names it.

    The user's own tokenizer file already there is left be; a different tokenizer there is an
    error without ``overwrite`` (token files of different tokenizers must not share a folder).
    """
    source_file = None if given is None else Path(given)  # tiktoken:NAME is no file
    if source_file is not None and source_file.is_dir():
        source_file = source_file / "tokenizer.json"
    if (
        source_file is not None
        and source_file.exists()
        and tok_path.exists()
        and tok_path.samefile(source_file)
    ):
        return tok_path
    if tok_path.exists() and _sha256(tok_path) != loaded.sha256 and not overwrite:
        raise OutputExists(
            f"{tok_path} holds a different tokenizer; write token files made with different "
            "tokenizers to different folders, or pass --overwrite to replace it"
        )
    return loaded.save(tok_path)


def _exact_chunking(loaded: DataPrepTokenizer, chunk_chars: int | None) -> int | None:
    """``chunk_chars``, or None (documents encoded whole) where cutting would change tokens."""
    if chunk_chars is not None and not chunking_is_exact(loaded.encode_pieces):
        log.warning(
            "this tokenizer does not encode a document cut at spaces to the same tokens as the "
            "whole, so documents are encoded whole: memory grows with the longest document"
        )
        return None
    return chunk_chars


_REWRITE_SIDECAR = (
    "write it with data_prep/adopt_tokens.py (token files made elsewhere) or "
    "data_prep/text_to_tokens.py"
)


def open_tokens(path: str | os.PathLike) -> tuple[np.memmap, dict[str, Any]]:
    """Open a token stream (its ``.bin`` or ``.json``) as a read-only memmap plus its metadata.

    Checks the file size against the sidecar so a partial or foreign file is never read.
    """
    path = Path(path)
    sidecar = path if path.suffix == ".json" else sidecar_path(path)
    if not sidecar.is_file():
        raise MissingInput(
            f"no sidecar {sidecar}: run data_prep/text_to_tokens.py to (re)make the token file, "
            "or data_prep/adopt_tokens.py to describe one made elsewhere"
        )
    try:
        meta = json.loads(sidecar.read_text())
    except json.JSONDecodeError as err:
        raise UserError(f"{sidecar} is not JSON ({err}); {_REWRITE_SIDECAR}") from None
    needed = {"tokens_file", "dtype", "num_tokens"}
    if not isinstance(meta, dict) or meta.get("format") != TOKENS_FORMAT or needed - meta.keys():
        raise UserError(
            f"{sidecar} is not a {TOKENS_FORMAT} sidecar (format, tokens_file, dtype, "
            f"num_tokens); {_REWRITE_SIDECAR}"
        )
    if Path(str(meta["tokens_file"])).name != meta["tokens_file"]:
        raise UserError(f"{sidecar}: tokens_file must be a file name beside it (no folders)")
    tokens_file = sidecar.parent / meta["tokens_file"]
    dtype = np.dtype(meta["dtype"])
    expected = meta["num_tokens"] * dtype.itemsize
    actual = tokens_file.stat().st_size if tokens_file.is_file() else -1
    if actual != expected:
        raise UserError(
            f"{tokens_file} is {actual} bytes, sidecar says {expected} "
            f"({meta['num_tokens']} x {dtype}); the file is incomplete or replaced"
        )
    return np.memmap(tokens_file, dtype=dtype, mode="r", shape=(meta["num_tokens"],)), meta


def open_doc_index(path: str | os.PathLike) -> np.ndarray:
    """Start offset of every document (needs a run with ``doc_boundaries=True``)."""
    _, meta = open_tokens(path)
    sidecar = Path(path) if Path(path).suffix == ".json" else sidecar_path(path)
    if not meta.get("doc_index"):
        raise UserError(f"{sidecar} has no document index; rerun with --doc-boundaries")
    starts = np.fromfile(sidecar.parent / meta["doc_index"], dtype=np.int64)
    if len(starts) != meta["num_documents"]:
        raise UserError(f"document index of {sidecar} is incomplete")
    return starts

"""Instruction data (.jsonl) -> MDS rows whose loss counts only the responses, for finetuning.

Each input line is one example, either a pair ``{"prompt": str, "response": str}`` (read as a
user turn and an assistant turn) or a conversation ``{"messages": [{"role", "content"}, ...]}``
with roles ``system``, ``user`` and ``assistant``. Inputs are local files or fsspec URLs.

Formatting. A tokenizer folder whose transformers config has a ``chat_template`` renders the
conversation with it, within the bounds of ``chat_template.py``'s sandbox (its special tokens,
such as ``<|im_start|>``, are encoded as such). Any other tokenizer gets the default format
(plain text, so it needs no new tokens)::

    ### System:\\n{content}\\n\\n       (untrained)
    ### User:\\n{content}\\n\\n         (untrained)
    ### Assistant:\\n                    (untrained)
    {content}<eos>                       (trained: the model learns the answer and to stop)

The same format ships as a chat template, ``templates/default_finetune.jinja``: rendered with
``add_generation_prompt`` it ends in ``### Assistant:\\n``, so a server prompts a model
finetuned in it with the tokens it trained on (`trained_chat_template` says when a run did).

Labels. ``labels`` equals ``input_ids`` on the tokens of assistant turns and is -100 on
everything else (system and user turns, role headers, padding), so only responses contribute
to the loss. The trainer's loss shifts labels by one itself (model.py ``loss``).

Rows. Every row has ``seq_len`` tokens. With packing, several examples share a row (first fit
over a window of open rows); ``sequence_id`` numbers the examples of a row (padding -1), and a
data config with that column makes attention stay inside each example. Without packing each
example gets its own padded row. Examples longer than ``seq_len`` are truncated or dropped
(``too_long``); one whose response falls entirely past the cut is dropped. The counts and the
packing efficiency (non-padding tokens / row tokens) are logged and recorded in meta.json.

Layout of ``out``::

    out/train/, out/val/   MDS: tokens ndarray:uint16|uint32:L, labels ndarray:int32:L,
                           sequence_id ndarray:int32:L
    out/tokenizer.json     the tokenizer (for training's generate callback and for eval;
                           tokenizer.model or NAME.tiktoken for SentencePiece or tiktoken)
    out/meta.json          seq_len, vocab/eos ids, format, counts, fingerprint (written last)
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from llmfoundry.core.metrics import IGNORE_INDEX
from llmfoundry.data.mds import MDSWriter
from llmfoundry.data.meta import meta_url, read_meta, write_meta
from llmfoundry.data.prep.chat_template import ChatTemplate
from llmfoundry.data.prep.reuse import previous_output, settings_fingerprint
from llmfoundry.tokenizers.tokenizer import DataPrepTokenizer, prepare_tokenizer
from llmfoundry.utils import storage
from llmfoundry.utils.errors import UserError
from llmfoundry.utils.files import join_url
from llmfoundry.utils.jsonl import MAX_LINE_BYTES, read_jsonl

__all__ = [
    "DEFAULT_FORMAT_TEMPLATE",
    "INSTRUCTIONS_META_FORMAT",
    "Formatter",
    "Packer",
    "instructions_to_mds",
    "read_conversations",
    "trained_chat_template",
]

log = logging.getLogger(__name__)

INSTRUCTIONS_META_FORMAT = "llmfoundry.mds-instructions"
IGNORE = IGNORE_INDEX  # the label the loss skips
DEFAULT_FORMAT_TEMPLATE = Path(__file__).with_name("templates") / "default_finetune.jinja"
ROLES = ("system", "user", "assistant")
TOO_LONG = ("truncate", "drop")


def _conversation(obj: dict[str, Any], where: str) -> list[dict[str, str]]:
    """One input line's example as a list of messages, validated."""
    if "messages" in obj:
        messages = obj["messages"]
        if not isinstance(messages, list) or not messages:
            raise UserError(f"{where}: 'messages' must be a non-empty list of {{role, content}}")
        for i, m in enumerate(messages):
            if (
                not isinstance(m, dict)
                or m.get("role") not in ROLES
                or not isinstance(m.get("content"), str)
            ):
                raise UserError(
                    f"{where}: messages[{i}] must be {{'role': one of {list(ROLES)}, "
                    f"'content': str}}, got {m!r}"
                )
        messages = [{"role": m["role"], "content": m["content"]} for m in messages]
    elif "prompt" in obj or "response" in obj:
        prompt, response = obj.get("prompt"), obj.get("response")
        if not isinstance(prompt, str) or not isinstance(response, str):
            raise UserError(f"{where}: 'prompt' and 'response' must both be strings")
        messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
    else:
        raise UserError(
            f"{where}: an example needs 'prompt' and 'response', or 'messages'; got keys "
            f"{sorted(obj)}"
        )
    if not any(m["role"] == "assistant" for m in messages):
        raise UserError(f"{where}: no assistant message, so nothing to train on")
    return messages


def read_conversations(
    urls: Sequence[str], max_example_bytes: int = MAX_LINE_BYTES
) -> Iterator[list[dict[str, str]]]:
    """Every example of the .jsonl files (local paths or fsspec URLs) as a list of messages; a
    line longer than `max_example_bytes` is refused while it is read."""
    for url in urls:
        for where, obj in read_jsonl(url, max_example_bytes):
            yield _conversation(obj, where)


def trained_chat_template(data: Mapping[str, Any] | None) -> str | None:
    """The default format's chat template when a run trained on instruction data in it, else
    None; `data` is the run's recorded data config (a checkpoint's ``config.data``).

    A checkpoint records where its data was, not how it was formatted, so the rule reads each
    training dataset's meta.json (``remote``, or every stream's): all of them instruction data
    written without a chat template means the default format. Data that cannot be read any more
    (moved, another machine) tells nothing: None, with a warning naming the template file.
    """
    if not isinstance(data, Mapping):
        return None
    streams = data.get("streams")
    remotes = (
        [s.get("remote") for s in streams.values() if isinstance(s, Mapping)]
        if isinstance(streams, Mapping)
        else [data.get("remote")]
    )
    if not remotes or not all(isinstance(r, str) for r in remotes):
        return None
    for remote in remotes:
        try:
            meta = read_meta(remote)
            problem = "not found" if meta is None else None
        except (OSError, UserError) as err:
            meta, problem = None, err
        if meta is None:
            log.warning(
                "cannot tell the finetune format of the run's data (%s: %s); a model finetuned in "
                "the default format chats with %s (scripts/serve.py --chat-template)",
                meta_url(remote),
                problem,
                DEFAULT_FORMAT_TEMPLATE,
            )
            return None
        if meta.get("format") != INSTRUCTIONS_META_FORMAT or meta.get("chat_template"):
            return None  # not instruction data, or formatted by the tokenizer's own template
    return DEFAULT_FORMAT_TEMPLATE.read_text(encoding="utf-8")


def _chat_template_tokenizer(path: str) -> Any | None:
    """The transformers tokenizer of a local folder whose config has a chat template, else None."""
    folder = Path(storage.local_path(path)) if storage.is_local(path) else None
    if folder is None or not folder.is_dir():
        return None
    config = folder / "tokenizer_config.json"
    has_template = (folder / "chat_template.jinja").is_file() or (
        config.is_file() and "chat_template" in json.loads(config.read_text(encoding="utf-8"))
    )
    if not has_template:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


class Formatter:
    """Turns a conversation into ``(input_ids, labels)`` (module docstring: Formatting)."""

    def __init__(self, tokenizer: str, eos_token: str | None = None) -> None:
        self.prepared: DataPrepTokenizer = prepare_tokenizer(tokenizer, eos_token)
        self.template: ChatTemplate | None = None
        hf = _chat_template_tokenizer(tokenizer)
        if hf is not None:
            self._variables = hf.special_tokens_map  # as transformers passes them
            self.template = ChatTemplate(hf.get_chat_template(), tokenizer, self._variables)
            # The template's text holds special tokens that must encode as themselves.
            self._special = hf.backend_tokenizer
            self._special.encode_special_tokens = False

    @property
    def uses_chat_template(self) -> bool:
        return self.template is not None

    def segments(self, messages: list[dict[str, str]]) -> list[tuple[str | int, bool]]:
        """The conversation as ``(text or token id, trained)`` pieces in order."""
        if self.template is None:
            pieces: list[tuple[str | int, bool]] = []
            for m in messages:
                header = f"### {m['role'].capitalize()}:\n"
                if m["role"] == "assistant":
                    pieces += [(header, False), (m["content"], True), (self.prepared.eos_id, True)]
                else:
                    pieces.append((f"{header}{m['content']}\n\n", False))
            return pieces

        template = self.template

        def render(upto: int, prompt: bool) -> str:
            return template.render(messages[:upto], prompt, self._variables)

        pieces, done = [], ""
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            prompt, full = render(i, True), render(i + 1, False)
            if not (prompt.startswith(done) and full.startswith(prompt)):
                raise UserError(
                    "the tokenizer's chat template does not render a conversation as a prefix of "
                    "its continuation, so response tokens cannot be told apart; use a tokenizer "
                    "without a chat template (the default format) or fix the template"
                )
            pieces += [(prompt[len(done) :], False), (full[len(prompt) :], True)]
            done = full
        rest = render(len(messages), False)
        if rest.startswith(done) and len(rest) > len(done):
            pieces.append((rest[len(done) :], False))
        return pieces

    def prompt(self, messages: list[dict[str, str]]) -> str:
        """The text a model continues to answer: everything before the first response, as
        formatted in training (for evaluation and serving prompts)."""
        text = ""
        for piece, trained in self.segments(messages):
            if trained:
                return text
            text += piece
        raise ValueError("the conversation has no assistant turn to answer")

    def encode(self, messages: list[dict[str, str]]) -> tuple[np.ndarray, np.ndarray]:
        """``(input_ids, labels)`` as int64 arrays; labels are -100 where not trained."""
        ids: list[int] = []
        labels: list[int] = []
        for piece, trained in self.segments(messages):
            if isinstance(piece, int):
                new = [piece]
            elif self.template is not None:
                new = self._special.encode(piece, add_special_tokens=False).ids
            else:
                new = self.prepared.encode(piece, add_special_tokens=False)
            ids += new
            labels += new if trained else [IGNORE] * len(new)
        return np.array(ids, np.int64), np.array(labels, np.int64)


@dataclass
class Packer:
    """Places examples into rows of ``seq_len`` tokens (module docstring: Rows).

    ``add`` returns the rows it completed; ``flush`` the rest. With ``pack`` an example goes
    into the first of up to ``window`` open rows with room for it; when none has room and the
    window is full, the oldest open row is closed first.
    """

    seq_len: int
    pad_id: int
    pack: bool = True
    window: int = 64
    rows: int = 0
    tokens: int = 0
    _open: list[list[tuple[np.ndarray, np.ndarray]]] = field(default_factory=list)

    def add(self, ids: np.ndarray, labels: np.ndarray) -> list[dict[str, np.ndarray]]:
        if not 0 < len(ids) <= self.seq_len:
            raise ValueError(f"an example of {len(ids)} tokens does not fit seq_len {self.seq_len}")
        if not self.pack:
            return [self._row([(ids, labels)])]
        done = []
        for row in self._open:
            if sum(len(i) for i, _ in row) + len(ids) <= self.seq_len:
                row.append((ids, labels))
                return done
        if len(self._open) >= self.window:
            done.append(self._row(self._open.pop(0)))
        self._open.append([(ids, labels)])
        return done

    def flush(self) -> list[dict[str, np.ndarray]]:
        done = [self._row(row) for row in self._open]
        self._open = []
        return done

    def _row(self, examples: list[tuple[np.ndarray, np.ndarray]]) -> dict[str, np.ndarray]:
        tokens = np.full(self.seq_len, self.pad_id, np.int64)
        labels = np.full(self.seq_len, IGNORE, np.int64)
        sequence_id = np.full(self.seq_len, -1, np.int64)
        start = 0
        for n, (ids, labs) in enumerate(examples):
            end = start + len(ids)
            tokens[start:end], labels[start:end], sequence_id[start:end] = ids, labs, n
            start = end
        self.rows += 1
        self.tokens += start
        return {"tokens": tokens, "labels": labels, "sequence_id": sequence_id}

    @property
    def efficiency(self) -> float:
        """Share of row tokens that are example tokens, not padding."""
        return self.tokens / (self.rows * self.seq_len) if self.rows else 0.0


def _content_hash(urls: Sequence[str]) -> str:
    digest = hashlib.sha256()
    for url in urls:
        with storage.open_url(url, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
        digest.update(b"\0")
    return digest.hexdigest()


def instructions_to_mds(
    inputs: Sequence[str],
    out: str,
    tokenizer: str,
    seq_len: int,
    *,
    pack: bool = True,
    too_long: str = "truncate",
    val_fraction: float = 0.0,
    seed: int = 17,
    eos_token: str | None = None,
    size_limit: int | str | None = 1 << 26,
    compression: str | None = None,
    overwrite: bool = False,
    max_example_bytes: int = MAX_LINE_BYTES,
) -> dict[str, Any]:
    """Write the instruction examples of ``inputs`` as MDS under ``out``; return meta.json's
    content (plus ``reused``). Examples go to ``val`` with probability ``val_fraction``
    (seeded by ``seed``), the rest to ``train``. A line of more than ``max_example_bytes`` is
    refused, naming it.
    """
    if seq_len < 2:
        raise UserError(f"--seq-len must be at least 2, got {seq_len}")
    if too_long not in TOO_LONG:
        raise UserError(f"--too-long must be one of {TOO_LONG}, got {too_long!r}")
    if not 0.0 <= val_fraction < 1.0:
        raise UserError(f"--val-fraction must be in [0, 1), got {val_fraction}")
    if not inputs:
        raise UserError("give at least one instruction .jsonl file")
    formatter = Formatter(tokenizer, eos_token)
    prepared = formatter.prepared
    settings = {
        "inputs": _content_hash(inputs),
        "tokenizer": prepared.sha256,
        "chat_template": formatter.uses_chat_template,
        "seq_len": seq_len,
        "pack": pack,
        "too_long": too_long,
        "val_fraction": val_fraction,
        "seed": seed,
        "size_limit": size_limit,
        "compression": compression,
        "version": 1,
    }
    key = settings_fingerprint(settings)
    previous = previous_output(out, key, overwrite)
    if previous is not None:
        log.info("%s: up to date (same inputs and settings), reused", out)
        return {**previous, "reused": True}
    fs, root = storage.url_to_fs(out)

    dtype = "uint16" if prepared.vocab_size <= (1 << 16) else "uint32"
    columns = {
        "tokens": f"ndarray:{dtype}:{seq_len}",
        "labels": f"ndarray:int32:{seq_len}",
        "sequence_id": f"ndarray:int32:{seq_len}",
    }
    counts = dict.fromkeys(("examples", "truncated", "dropped_too_long", "dropped_no_response"), 0)
    counts["response_tokens"] = 0
    packers = {s: Packer(seq_len, prepared.eos_id, pack) for s in ("train", "val")}
    writers = {
        s: MDSWriter(
            join_url(out, s),
            columns,
            compression=compression,
            size_limit=size_limit,
            exist_ok=overwrite,
        )
        for s in (("train", "val") if val_fraction > 0 else ("train",))
    }
    rng = random.Random(seed)

    def write(split: str, rows: Iterable[dict[str, np.ndarray]]) -> None:
        for row in rows:
            writers[split].write(
                {
                    "tokens": row["tokens"].astype(dtype),
                    "labels": row["labels"].astype(np.int32),
                    "sequence_id": row["sequence_id"].astype(np.int32),
                }
            )

    try:
        for messages in read_conversations(inputs, max_example_bytes):
            counts["examples"] += 1
            split = "val" if val_fraction > 0 and rng.random() < val_fraction else "train"
            ids, labels = formatter.encode(messages)
            if len(ids) > seq_len:
                if too_long == "drop":
                    counts["dropped_too_long"] += 1
                    continue
                counts["truncated"] += 1
                ids, labels = ids[:seq_len], labels[:seq_len]
            # labels[0] is never predicted (the loss shifts by one): it needs a later one.
            trained = int((labels[1:] != IGNORE).sum())
            if trained == 0:
                counts["dropped_no_response"] += 1
                continue
            counts["response_tokens"] += trained
            write(split, packers[split].add(ids, labels))
        for split, packer in packers.items():
            write(split, packer.flush())
    except BaseException:
        for writer in writers.values():
            writer.abort()
        raise
    written = {}
    for split, writer in writers.items():
        writer.finish()
        rows = packers[split].rows
        if rows == 0:
            raise UserError(
                f"no {split} example left (counts: {counts}); give more examples, a larger "
                "--seq-len or --too-long truncate"
                + (", or a larger --val-fraction" if split == "val" else "")
            )
        written[split] = {
            "rows": rows,
            "shards": len(writer.shards),
            "folder": split,
            "packing_efficiency": round(packers[split].efficiency, 4),
        }
    if "val" not in written and fs.exists(join_url(root, "val/index.json")):
        fs.rm(join_url(root, "val"), recursive=True)  # stale split from an earlier run
    fs.pipe_file(join_url(root, prepared.file_name), prepared.file_data)
    total_rows = sum(p.rows for p in packers.values())
    efficiency = sum(p.tokens for p in packers.values()) / (total_rows * seq_len)
    meta = {
        "format": INSTRUCTIONS_META_FORMAT,
        "version": 1,
        "seq_len": seq_len,
        "dtype": dtype,
        "columns": columns,
        "vocab_size": prepared.vocab_size,
        "eos_id": prepared.eos_id,
        "bos_id": prepared.bos_id,
        "tokenizer": prepared.file_name,
        "chat_template": formatter.uses_chat_template,
        "packed": pack,
        "packing_efficiency": round(efficiency, 4),
        "splits": written,
        **counts,
        "fingerprint": key,
    }
    log.info(
        "%s: %d examples -> %d rows of %d tokens (%s, efficiency %.1f%%); truncated %d, "
        "dropped %d too long and %d without response tokens; %d response tokens",
        out,
        counts["examples"],
        total_rows,
        seq_len,
        "packed" if pack else "padded",
        100 * efficiency,
        counts["truncated"],
        counts["dropped_too_long"],
        counts["dropped_no_response"],
        counts["response_tokens"],
    )
    write_meta(out, meta)
    return {**meta, "reused": False}

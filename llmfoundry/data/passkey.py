"""The synthetic passkey-retrieval task: rows that hide a key far back, written as MDS, and scored.

A row of `seq_len` tokens is filler with a `n_digits`-digit passkey written once somewhere in
it, and ends with a query token followed by the same digits:

    w3 w4 w5 ... w9 [7 2] w0 w1 ... w7 <query> [7 2]

The filler is a cycle of `n_filler` words from a random phase, so a model predicts it from the
previous token alone and its loss soon stops competing with the passkey; the digits occur
nowhere else, so the only way to predict the answer is to remember the key. Scoring feeds each
row and takes the argmax at the answer positions (teacher-forced, which gives the same exact
match as greedy decoding); accuracy is reported per depth, the distance from the key to the
query in units of the model's attention window (a segment for infini-attention), so depth 0 is
inside the window and depth >= 1 needs a memory.

The rows go through the ordinary pipeline: `write_passkey_dataset` writes ``train/`` and
``val/`` MDS splits with the repo's `MDSWriter`, a word-level tokenizer.json (so samples print
as words) and meta.json, the layout of data_prep/tokens_to_mds.py, so `scripts/train.py
data.remote=<out>` trains on it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, models, pre_tokenizers

from llmfoundry.data.mds import MDSWriter
from llmfoundry.data.meta import meta_url, read_meta, write_meta
from llmfoundry.utils.errors import MissingInput, UserError

__all__ = ["PasskeyTask", "score_passkey", "write_passkey_dataset"]

META_FORMAT = "llmfoundry.passkey"
EOS, QUERY = "<eos>", "<query>"


@dataclass(frozen=True)
class PasskeyTask:
    """Row length, passkey length and filler size; fixes the vocabulary.

    Token ids: 0 ``<eos>`` (unused in rows, kept for tools that expect one), 1 ``<query>``,
    2-11 the digits 0-9, then the filler words ``w0``, ``w1``, ...
    """

    seq_len: int
    n_digits: int = 2
    n_filler: int = 16

    def __post_init__(self) -> None:
        if self.n_digits < 1 or self.n_filler < 2:
            raise UserError("passkey needs n_digits >= 1 and n_filler >= 2")
        if self.seq_len < 3 * self.n_digits + 2:
            raise UserError(
                f"seq_len={self.seq_len} leaves no room for a {self.n_digits}-digit key, its "
                f"query and answer; use seq_len >= {3 * self.n_digits + 2}"
            )

    @property
    def vocab(self) -> list[str]:
        digits = [str(d) for d in range(10)]
        return [EOS, QUERY, *digits, *(f"w{i}" for i in range(self.n_filler))]

    @property
    def query_pos(self) -> int:
        """Index of the query token; the answer's digits follow it to the row's end."""
        return self.seq_len - 1 - self.n_digits

    def rows(self, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
        """`n` rows [n, seq_len] (uint16) and each row's key position [n]."""
        rng = np.random.default_rng(seed)
        phase = rng.integers(0, self.n_filler, size=(n, 1))
        filler = 12 + (phase + np.arange(self.seq_len)) % self.n_filler
        rows = filler.astype(np.uint16)
        key = rng.integers(0, 10, size=(n, self.n_digits)) + 2
        last_start = self.query_pos - self.n_digits  # the key ends before the query
        key_pos = rng.integers(0, last_start + 1, size=n)
        index = key_pos[:, None] + np.arange(self.n_digits)
        np.put_along_axis(rows, index, key, axis=1)
        rows[:, self.query_pos] = 1
        rows[:, self.query_pos + 1 :] = key
        return rows, key_pos

    def tokenizer(self) -> Tokenizer:
        vocab = {word: i for i, word in enumerate(self.vocab)}
        tok = Tokenizer(models.WordLevel(vocab, unk_token=EOS))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        return tok


def write_passkey_dataset(
    out: str | Path, task: PasskeyTask, train_rows: int, val_rows: int, seed: int = 0
) -> dict:
    """Write train/ and val/ MDS splits, tokenizer.json and meta.json under the folder `out`.

    Train and validation rows come from different seeds, so no validation row is a training row
    (at this vocabulary a repeat is possible only by chance).
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    column = {"tokens": f"ndarray:uint16:{task.seq_len}"}
    for split, n, split_seed in (("train", train_rows, seed), ("val", val_rows, seed + 1)):
        if n < 1:
            raise UserError(f"passkey {split} split needs at least one row, got {n}")
        rows, _ = task.rows(n, split_seed)
        with MDSWriter(out / split, column, exist_ok=True) as writer:
            for row in rows:
                writer.write({"tokens": row})
    task.tokenizer().save(str(out / "tokenizer.json"))
    meta = {
        "format": META_FORMAT,
        "version": 1,
        "seq_len": task.seq_len,
        "n_digits": task.n_digits,
        "n_filler": task.n_filler,
        "vocab_size": len(task.vocab),
        "eos_id": 0,
        "bos_id": None,
        "tokenizer": "tokenizer.json",
        "splits": {"train": {"rows": train_rows}, "val": {"rows": val_rows}},
        "seed": seed,
    }
    write_meta(str(out), meta)
    return meta


def read_task(folder: str | Path) -> PasskeyTask:
    """The task a passkey dataset folder was written with (from its meta.json)."""
    meta = read_meta(str(folder))
    where = meta_url(str(folder))
    if meta is None:
        raise MissingInput(f"{where} not found: point at a folder written by data_prep/passkey.py")
    if meta.get("format") != META_FORMAT:
        raise UserError(f"{where} is not a passkey dataset (format {meta.get('format')!r})")
    fields = ("seq_len", "n_digits", "n_filler")
    if not all(isinstance(meta.get(name), int) for name in fields):
        raise UserError(
            f"{where} lacks the task's {', '.join(fields)}; rewrite it with data_prep/passkey.py"
        )
    return PasskeyTask(*(meta[name] for name in fields))


@torch.no_grad()
def score_passkey(
    logits_fn: Callable[[torch.Tensor], torch.Tensor],
    rows: torch.Tensor,
    task: PasskeyTask,
    window: int,
    batch_size: int = 32,
) -> dict[int, tuple[int, int]]:
    """Exact-match retrieval per depth: {depth: (correct, total)}.

    `logits_fn(ids [B, L]) -> [B, L, vocab]`. Depth is (query position - key position) //
    `window`: 0 means the key is inside the window, d >= 1 that it is d windows back.
    """
    rows = rows.long()
    answer = slice(task.query_pos, task.seq_len - 1)  # logits there predict the digits
    is_digit = (rows[:, : task.query_pos] >= 2) & (rows[:, : task.query_pos] <= 11)
    key_pos = is_digit.int().argmax(dim=1)
    depth = (task.query_pos - key_pos) // window
    correct = torch.zeros(len(rows), dtype=torch.bool)
    for start in range(0, len(rows), batch_size):
        ids = rows[start : start + batch_size]
        guess = logits_fn(ids)[:, answer].argmax(dim=-1).cpu()
        correct[start : start + batch_size] = (guess == ids[:, answer.start + 1 :].cpu()).all(1)
    return {
        int(d): (int(correct[depth == d].sum()), int((depth == d).sum()))
        for d in depth.unique().tolist()
    }

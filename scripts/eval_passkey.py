"""Passkey retrieval accuracy of a checkpoint, per depth in attention windows.

    python scripts/eval_passkey.py outputs/<run>/checkpoints --data data/passkey [--json out.json]

Reads the val split of a dataset written by data_prep/passkey.py. The window is the span a
token's attention reaches: an infini-attention segment, else the sliding window, else the whole
row. Depth 0 rows hold the key inside that window; depth >= 1 rows need memory beyond it, where
chance is 10^-n_digits. Stacked sliding-window layers reach n_layers * (window - 1) tokens back,
so a plain model can beat chance at depths up to about n_layers - 1; beyond that only a memory
can. (Infini-attention's local attention stops at segment boundaries in every layer.)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from llmfoundry.checkpoint.pretrained import load_pretrained
from llmfoundry.data.passkey import read_task, score_passkey
from llmfoundry.data.streaming import StreamingDataLoader
from llmfoundry.data.text import StreamingTextDataset
from llmfoundry.models.families import family_of
from llmfoundry.utils.cli import add_script_arguments, script_errors


def attention_window(config, seq_len: int) -> int:
    """How far back a token's attention reaches in one forward (its family says)."""
    return family_of(config).attention_window(config) or seq_len


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("checkpoint", help="checkpoint folder, or a save folder (its latest)")
    parser.add_argument("--data", required=True, help="folder written by data_prep/passkey.py")
    parser.add_argument("--split", default="val")
    parser.add_argument("--rows", type=int, default=None, help="score only the first N rows")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--json", help="also write the results to this file")
    add_script_arguments(parser)
    args = parser.parse_args(argv)
    with script_errors(args):
        return run(args)


def run(args: argparse.Namespace) -> int:
    task = read_task(args.data)
    loader = StreamingDataLoader(
        StreamingTextDataset(args.data, split=args.split, batch_size=args.batch_size)
    )
    loader.set_epoch(0)
    rows = torch.cat([batch["input_ids"] for batch in loader])[: args.rows]
    n = len(rows)
    model, _ = load_pretrained(args.checkpoint)
    window = attention_window(model.config, task.seq_len)
    scores = score_passkey(model, rows, task, window, args.batch_size)
    chance = 10.0**-task.n_digits
    print(f"window {window} tokens, {n} rows, chance {chance:.3g}")
    print("depth (windows back)  rows  accuracy")
    results = {}
    for depth, (correct, total) in sorted(scores.items()):
        results[depth] = {"correct": correct, "rows": total, "accuracy": correct / total}
        print(f"{depth:>20}  {total:>4}  {correct / total:.3f}")
    beyond = [scores[d] for d in scores if d >= 1]
    if beyond:
        correct, total = map(sum, zip(*beyond, strict=True))
        print(f"{'beyond one window':>20}  {total:>4}  {correct / total:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"window": window, "depths": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

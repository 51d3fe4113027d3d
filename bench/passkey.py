"""Passkey retrieval beyond the attention window: infini-attention against a plain model.

Trains two models in one run, on the same passkey rows (llmfoundry/data/passkey.py), from the
same seed, for the same steps, with the recipe's trainer (`build_trainer` over conf/train.yaml,
the same path as scripts/train.py) and scores each checkpoint with scripts/eval_passkey.py:

  infini : every block infini-attention (`+model/infini=<update>`), segments of `--window`
           tokens plus the compressive memory;
  plain  : the same shape with `model.sliding_window=<window>`, the same reach per layer and no
           memory.

Rows are `--seq-len` tokens, several windows, and the key lies anywhere before the query, so
the evaluator's depths (query - key, in windows) run from 0 to seq_len / window - 1. Stacked
sliding-window layers reach n_layers * (window - 1) tokens back, so the plain model can beat
chance at depths below about n_layers; beyond that only a memory can. Chance is
10^-n_digits. The table (stdout; the scores also in `--json`) has accuracy per depth for both
sides and summed over the depths beyond one window and beyond the plain model's reach; `--keep`
keeps the data, checkpoints and training logs (train.log, metrics.jsonl).

    PYTHONPATH=. OMP_NUM_THREADS=1 python bench/passkey.py                  # bench/RESULTS.md
    PYTHONPATH=. OMP_NUM_THREADS=1 python bench/passkey.py --steps 40 --val-rows 50   # smoke

Each side is equivalent to (the data from data_prep/passkey.py with the same settings):

    python scripts/train.py data.remote=<data> model.vocab_size=28 model.max_seq_len=128 \\
        model.d_model=64 model.n_layers=2 +model/infini=delta model.infini.segment_len=16 ...
    python scripts/eval_passkey.py outputs/<run>/checkpoints --data <data>
"""

from __future__ import annotations

import argparse
import json
import runpy
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from llmfoundry.build import build_trainer
from llmfoundry.config.preflight import compose_config
from llmfoundry.data.passkey import PasskeyTask, write_passkey_dataset
from llmfoundry.utils.errors import UserError, exit_on_user_error
from llmfoundry.utils.logs import configure_logging

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
SIDES = ("infini", "plain")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per row (128)")
    parser.add_argument("--window", type=int, default=16, help="segment / sliding window (16)")
    parser.add_argument("--n-digits", type=int, default=2, help="passkey digits (2)")
    parser.add_argument("--n-filler", type=int, default=16, help="filler words (16)")
    parser.add_argument("--update", choices=("delta", "linear"), default="delta")
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--n-heads", type=int, default=4)
    parser.add_argument("--n-layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4000, help="training batches per side")
    parser.add_argument("--batch", type=int, default=32, help="rows per batch (32)")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--val-rows", type=int, default=1000, help="rows scored per side")
    parser.add_argument("--seed", type=int, default=17)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--keep", help="keep data, checkpoints and logs in this folder")
    parser.add_argument("--debug", action="store_true", help="show the traceback of errors")
    args = parser.parse_args(argv)
    if args.window >= args.seq_len:
        parser.error(
            f"--window {args.window} must be shorter than --seq-len {args.seq_len}: the bench "
            "measures retrieval beyond the window"
        )
    if min(args.steps, args.batch, args.val_rows, args.threads) < 1:
        parser.error("--steps, --batch, --val-rows and --threads must be positive")
    try:
        PasskeyTask(args.seq_len, args.n_digits, args.n_filler)
    except ValueError as err:
        parser.error(str(err))
    return args


def side_overrides(side: str, args: argparse.Namespace, task: PasskeyTask, root: Path) -> list[str]:
    """The conf/train.yaml overrides that train one side; only the attention differs."""
    attention = (
        [f"+model/infini={args.update}", f"model.infini.segment_len={args.window}"]
        if side == "infini"
        else [f"model.sliding_window={args.window}"]
    )
    return [
        "model=mpt-tiny",
        f"model.d_model={args.d_model}",
        f"model.n_heads={args.n_heads}",
        f"model.n_layers={args.n_layers}",
        f"model.vocab_size={len(task.vocab)}",
        f"model.max_seq_len={args.seq_len}",
        *attention,
        f"data.remote={root / 'data'}",
        f"global_train_batch_size={args.batch}",
        f"max_duration={args.steps}ba",
        f"optimizer.lr={args.lr}",
        f"scheduler.t_warmup={max(1, args.steps // 20)}ba",
        f"seed={args.seed}",
        f"run_name=passkey-{side}",
        f"save_folder={root / side / 'checkpoints'}",
        f"save_interval={args.steps}ba",
        f"eval_interval={args.steps}ba",
        "eval_first=false",
        # Not the recipe's sample at fit end (it prompts "def ", which this vocabulary lacks)
        # nor its speed monitor (seconds of peak-flops matmuls; the bench times CPU itself).
        "callbacks=[lr_monitor,nan_detector]",
        "loggers=[console,jsonl]",
        f"loggers.console.log_interval={max(1, args.steps // 10)}ba",
    ]


def train_and_score(side: str, args: argparse.Namespace, task: PasskeyTask, root: Path) -> dict:
    """Train one side, then score its checkpoint with scripts/eval_passkey.py."""
    print(
        f"\n== {side}: training {args.steps} batches of {args.batch} x {args.seq_len}", flush=True
    )
    cfg = compose_config(CONF, side_overrides(side, args, task, root))
    configure_logging(root / side / "run" / "train.log")  # the console logger's lines
    start = time.process_time()
    trainer = build_trainer(cfg, root / side / "run")
    trainer.fit()
    train_cpu_s = time.process_time() - start
    scores_file = root / side / "passkey.json"
    evaluator = runpy.run_path(str(ROOT / "scripts" / "eval_passkey.py"))["main"]
    argv = [str(root / side / "checkpoints"), "--data", str(root / "data")]
    evaluator([*argv, "--batch-size", "100", "--json", str(scores_file)])
    scores = json.loads(scores_file.read_text())
    scores["train_cpu_s"] = train_cpu_s
    return scores


def plain_reach_depth(window: int, n_layers: int) -> int:
    """The first depth no key of which the plain model can see: its layers reach
    n_layers * (window - 1) tokens back, and depth d holds distances from d * window on."""
    return n_layers * (window - 1) // window + 1


def table(results: dict[str, dict], task: PasskeyTask, n_layers: int) -> list[str]:
    """Markdown rows: accuracy per depth for both sides, over every depth beyond one window,
    and over every depth beyond the plain model's reach."""
    window = results["infini"]["window"]
    lines = [
        "| depth (windows back) | key distance (tokens) | rows | infini | plain |",
        "|---:|---|---:|---:|---:|",
    ]
    depths = sorted(results["infini"]["depths"], key=int)
    for depth in depths:
        cells = [results[side]["depths"][depth] for side in SIDES]
        lo, hi = int(depth) * window, (int(depth) + 1) * window - 1
        acc = " | ".join(f"{c['accuracy']:.3f}" for c in cells)
        lines.append(f"| {depth} | {lo}-{hi} | {cells[0]['rows']} | {acc} |")
    sums = [(1, "beyond one window")]
    if (reach := plain_reach_depth(window, n_layers)) > 1:  # else the same rows as the first
        sums.append((reach, "beyond the plain model's reach"))
    for first, label in sums:
        if first > int(depths[-1]):
            continue  # no rows that far back
        summed = []
        for side in SIDES:
            far = [v for d, v in results[side]["depths"].items() if int(d) >= first]
            summed.append((sum(v["correct"] for v in far), sum(v["rows"] for v in far)))
        acc = " | ".join(f"**{c / n:.3f}** ({c}/{n})" for c, n in summed)
        lines.append(f"| >= {first} ({label}) | >= {first * window} | {summed[0][1]} | {acc} |")
    lines.append(f"| chance | | | {10.0**-task.n_digits:.3f} | {10.0**-task.n_digits:.3f} |")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    task = PasskeyTask(args.seq_len, args.n_digits, args.n_filler)
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="bench-passkey-"))
    wall = time.perf_counter()
    with exit_on_user_error(args.debug):
        if args.keep and root.exists() and any(root.iterdir()):
            raise UserError(f"--keep {root} is not empty; name a new or empty folder")
        try:
            write_passkey_dataset(
                root / "data", task, args.steps * args.batch, args.val_rows, seed=args.seed
            )
            results = {side: train_and_score(side, args, task, root) for side in SIDES}
        finally:
            if not args.keep:
                shutil.rmtree(root, ignore_errors=True)
    lines = table(results, task, args.n_layers)
    print(
        f"\n== passkey retrieval, {args.val_rows} val rows of {args.seq_len} tokens "
        f"({args.seq_len // args.window} windows of {args.window}), {args.n_digits}-digit key; "
        f"d_model {args.d_model}, {args.n_layers} layers, {args.n_heads} heads, {args.steps} "
        f"batches of {args.batch}, lr {args.lr}, seed {args.seed}, infini update {args.update}; "
        f"train CPU s: infini {results['infini']['train_cpu_s']:.0f}, plain "
        f"{results['plain']['train_cpu_s']:.0f}; wall {time.perf_counter() - wall:.0f} s"
    )
    print("\n".join(lines))
    if args.json:
        payload = {"settings": vars(args), "chance": 10.0**-task.n_digits, **results}
        Path(args.json).write_text(json.dumps(payload, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

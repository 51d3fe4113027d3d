"""What an icl_eval pass costs next to training: 500 multiple-choice questions against 3 steps.

Issue 35's target: an `icl_eval` pass of 500 multiple-choice questions (4 choices, 0-shot) costs
at most 3 training steps' time of the same model. Both run here in one process, in alternating
rounds on the same model:

  steps : `--steps` training steps (forward, loss, backward, clipping 1.0, DecoupledAdamW) on
          the config's per-device batch of random tokens at the model's max_seq_len;
  pass  : `evaluate_tasks` (llmfoundry/eval/icl.py, as the icl_eval callback runs it: every
          question, `ModelForward`, `--batch-size` rows per forward) on `--questions` synthetic
          questions whose lengths are drawn like ARC's and HellaSwag's (a context of
          `--context` tokens and choices of `--choice` tokens, uniform in those ranges).

The model and batch are conf/train.yaml's (mpt-tiny, global_train_batch_size 8 on one
process) unless overridden (`model=mpt-125m global_train_batch_size=...`). Prints the median
time of each over `--rounds` rounds after a warm-up round, their ratio, and the ratio of their
model flops (2N per token forward, 6N per training token, attention left out), which bounds
what batching can reach: the pass cannot cost less than its flops.

The clock is this process's CPU time on `--threads` threads (1 by default, as the other CPU
benchmarks: other jobs on a shared machine distort it much less than wall time); `--wall`
times wall-clock instead (an accelerator: `--device cuda`, synchronised).

    python bench/icl_overhead.py                       # the issue's measurement, a few minutes
    python bench/icl_overhead.py --batch-size 64 global_train_batch_size=32
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from hydra.utils import instantiate
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit

from llmfoundry.config.preflight import compose_config
from llmfoundry.eval.icl import BATCH_SIZE, Task, evaluate_tasks
from llmfoundry.models.mpt import MPTConfig, MPTForCausalLM
from llmfoundry.optim import DecoupledAdamW
from llmfoundry.optim.param_groups import build_param_groups
from llmfoundry.tokenizers.tokenizer import prepare

CONF = Path(__file__).resolve().parents[1] / "conf"
LR, CLIP = 1e-3, 1.0


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("overrides", nargs="*", help="conf/ overrides (model=..., model.n_layers=...)")
    p.add_argument("--questions", type=int, default=500, help="questions in the pass (500)")
    p.add_argument("--choices", type=int, default=4, help="choices per question (4)")
    p.add_argument("--context", type=int, nargs=2, default=[32, 96], help="tokens (32 96)")
    p.add_argument("--choice", type=int, nargs=2, default=[4, 24], help="tokens (4 24)")
    p.add_argument("--steps", type=int, default=3, help="training steps to compare with (3)")
    p.add_argument("--batch-size", type=int, default=BATCH_SIZE, help="rows per eval forward")
    p.add_argument("--rounds", type=int, default=2, help="timed rounds after warm-up (2)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--wall", action="store_true", help="wall-clock time instead of CPU time")
    args = p.parse_args(argv)
    counts = (args.questions, args.choices - 1, args.steps, args.batch_size, args.rounds)
    if min(counts) < 1 or min(args.context + args.choice) < 1:
        p.error("counts and lengths must be positive (and --choices at least 2)")
    if args.context[0] > args.context[1] or args.choice[0] > args.choice[1]:
        p.error("--context and --choice take MIN MAX")
    return args


def questions(args: argparse.Namespace, vocab_size: int) -> tuple[Task, object]:
    """The synthetic task (one token per word) and a word-level tokenizer for it."""
    rng = random.Random(0)
    word = lambda: f"t{rng.randrange(vocab_size)}"  # noqa: E731
    text = lambda bounds: " ".join(word() for _ in range(rng.randint(*bounds)))  # noqa: E731
    examples = [
        {
            "query": text(args.context),
            "choices": [" " + text(args.choice) for _ in range(args.choices)],
            "gold": rng.randrange(args.choices),
        }
        for _ in range(args.questions)
    ]
    tok = Tokenizer(WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = WhitespaceSplit()
    return Task("mc", "multiple_choice", examples), prepare(tok, require_eos=False)


def train_step(model: MPTForCausalLM, ids: torch.Tensor) -> Callable[[], None]:
    optimizer = DecoupledAdamW(build_param_groups(model), lr=LR)

    def step() -> None:
        model.train()
        loss = model.loss(model(ids), ids)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def timed(fn: Callable[[], object], args: argparse.Namespace) -> float:
    clock = time.perf_counter if args.wall else time.process_time
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    sync()
    start = clock()
    fn()
    sync()
    return clock() - start


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = compose_config(CONF, list(args.overrides))
    model_cfg: MPTConfig = instantiate(cfg.model)
    seq_len = cfg.max_seq_len or model_cfg.max_seq_len
    batch = cfg.device_train_microbatch_size or cfg.global_train_batch_size
    torch.manual_seed(0)
    device = torch.device(args.device)
    model = MPTForCausalLM(dataclasses.replace(model_cfg, init_device="cpu")).to(device)
    ids = torch.randint(0, model_cfg.vocab_size, (batch, seq_len), device=device)
    task, tokenizer = questions(args, model_cfg.vocab_size)

    def steps() -> None:
        for _ in range(args.steps):
            step()

    def icl_pass() -> dict:
        return evaluate_tasks(model, tokenizer, [task], batch_size=args.batch_size)

    step = train_step(model, ids)
    times: dict[str, list[float]] = {"steps": [], "pass": []}
    for round_ in range(args.rounds + 1):  # the first is warm-up
        for name, fn in (("steps", steps), ("pass", icl_pass)):
            seconds = timed(fn, args)
            if round_:
                times[name].append(seconds)
    median = {name: statistics.median(t) for name, t in times.items()}
    n_params = sum(p.numel() for p in model.parameters())
    rows = sum(len(e["choices"]) for e in task.examples)
    pass_tokens = sum(
        len(tokenizer.encode(e["query"])) * len(e["choices"])
        + sum(len(tokenizer.encode(c)) for c in e["choices"])
        for e in task.examples
    )
    step_tokens = args.steps * batch * seq_len
    flops_ratio = (2 * pass_tokens) / (6 * step_tokens)
    clock = "wall" if args.wall else f"CPU time, {args.threads} thread(s)"
    print(
        f"model: {n_params / 1e6:.1f}M parameters, max_seq_len {seq_len}; training batch "
        f"{batch} x {seq_len}; {clock}; median of {args.rounds} rounds"
    )
    print(f"{args.steps} training steps: {median['steps']:.2f} s ({step_tokens:,} tokens)")
    print(
        f"icl pass: {median['pass']:.2f} s ({args.questions} questions, {rows} rows, "
        f"{pass_tokens:,} tokens, batch {args.batch_size})"
    )
    ratio = median["pass"] / median["steps"]
    print(f"pass / {args.steps} steps: {ratio:.2f} (target <= 1)")
    print(f"flops of the pass / {args.steps} steps: {flops_ratio:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

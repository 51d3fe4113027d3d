"""KV-cache decoding speed-up: `generate` with the cache vs recomputing the sequence each step.

The model is mpt-tiny's shape (d_model 256, 4 layers, 4 heads, 8192-token vocabulary, ALiBi)
with random weights; both sides decode the same left-padded batch greedily and must produce the
same tokens (checked before timing). Rounds alternate between the sides; the best round of each
and their ratio are printed. Without a cache every step reruns the whole sequence, so the ratio
grows with the number of new tokens. The clock is this process's CPU time (torch runs with
one thread unless --threads), so other jobs on a shared machine distort it less than wall time.

    python bench/generation.py                          # batch 4, 32-token prompts, 224 new
    python bench/generation.py --new-tokens 64 --infini 64
"""

from __future__ import annotations

import argparse
import time

import torch

from llmfoundry.models.generation import GenerationConfig, generate, left_pad
from llmfoundry.models.mpt import MPTConfig, MPTForCausalLM


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batch-size", type=int, default=4, help="prompts per batch (default 4)")
    p.add_argument("--prompt-len", type=int, default=32, help="longest prompt (default 32)")
    p.add_argument("--new-tokens", type=int, default=224, help="tokens to generate (default 224)")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds per side (default 3)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    p.add_argument("--attn-impl", default="sdpa", help="attention kernel (default sdpa)")
    p.add_argument("--infini", type=int, default=None, help="infini-attention segment length")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    infini = None if args.infini is None else {"segment_len": args.infini}
    config = MPTConfig(
        d_model=256,
        n_heads=4,
        n_layers=4,
        max_seq_len=256,
        vocab_size=8192,
        attn_impl=args.attn_impl,
        infini=infini,
    )
    model = MPTForCausalLM(config).eval()
    lengths = [args.prompt_len - (i * 5) % args.prompt_len for i in range(args.batch_size)]
    if infini is not None:  # infini rows are not padded: one length
        lengths = [args.prompt_len] * args.batch_size
    prompts = [torch.randint(0, 8192, (n,)).tolist() for n in lengths]
    ids, mask = left_pad(prompts)
    greedy = GenerationConfig(max_new_tokens=args.new_tokens, temperature=0)

    def run(use_cache: bool) -> tuple[float, list[list[int]]]:
        start = time.process_time()
        out = generate(model, ids, mask, greedy, use_cache=use_cache)
        return time.process_time() - start, out.tokens

    cached_tokens, recomputed_tokens = run(True)[1], run(False)[1]
    if cached_tokens != recomputed_tokens:
        raise SystemExit("the KV cache and recomputation disagree; not timing a wrong result")
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(args.rounds):
        for use_cache in (True, False):
            times[use_cache].append(run(use_cache)[0])
    best_cache, best_full = min(times[True]), min(times[False])
    tokens = args.batch_size * args.new_tokens
    print(
        f"batch {args.batch_size}, prompts up to {args.prompt_len} tokens, {args.new_tokens} new "
        f"tokens, {args.threads} thread(s), attn_impl={args.attn_impl}"
        + (f", infini segment {args.infini}" if infini else "")
    )
    print(f"KV cache:      {best_cache:7.3f} s CPU  ({tokens / best_cache:8.1f} tokens/s)")
    print(f"recomputation: {best_full:7.3f} s CPU  ({tokens / best_full:8.1f} tokens/s)")
    print(f"speed-up: {best_full / best_cache:.2f}x")


if __name__ == "__main__":
    main()

"""Continue prompts with a trained model: a checkpoint (or save folder), a Composer checkpoint or a transformers MPT or Llama folder.

    python scripts/generate.py outputs/run/checkpoints --prompt "def " --prompt "import"
    python scripts/generate.py hf_out/ --prompt "def add(" --temperature 0 --max-new-tokens 40
    python scripts/generate.py CKPT --prompts-file prompts.txt --top-p 0.9 --stop $'\\n\\n' --seed 1

All prompts go in one batch (left-padded), decoded with a KV cache (--no-cache recomputes the
whole sequence at every step instead). Sampling: --temperature (0: greedy), --top-k, --top-p,
--repetition-penalty, --seed; a row ends at EOS, at a --stop string (cut from the output) or
after --max-new-tokens. Each prompt is printed with its continuation and why it ended. A wrong
path or option ends with one line and status 2 (--debug: the traceback).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from llmfoundry.checkpoint.pretrained import WEIGHT_DTYPES, load_pretrained
from llmfoundry.distributed.base import resolve_device
from llmfoundry.models.generation import GenerationConfig, generate, left_pad
from llmfoundry.tokenizers.tokenizer import prepare_tokenizer
from llmfoundry.utils.cli import add_script_arguments, script_errors
from llmfoundry.utils.errors import UserError


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "model",
        help="checkpoint, save folder, Composer checkpoint (*-rank0.pt or its sharded folder), or "
        "transformers MPT/Llama folder",
    )
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    p.add_argument("--prompts-file", type=Path, help="a file of prompts, one per line")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.8, help="0: greedy (default 0.8)")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed of every prompt")
    p.add_argument(
        "--tokenizer",
        help="tokenizer.json, tokenizer folder, .model, .tiktoken or tiktoken:NAME (default: found)",
    )
    p.add_argument("--eos-token", help="EOS token (default <|endoftext|> when it exists)")
    p.add_argument("--device", default="cpu", help="torch device (default cpu)")
    p.add_argument(
        "--dtype", choices=WEIGHT_DTYPES, default="fp32", help="weights' dtype (default fp32)"
    )
    p.add_argument("--no-cache", action="store_true", help="recompute instead of a KV cache")
    add_script_arguments(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with script_errors(args):
        return run(args)


def read_prompts(path: Path) -> list[str]:
    """The non-empty lines of a prompts file."""
    try:
        return [line for line in path.read_text(encoding="utf-8").splitlines() if line]
    except OSError as err:
        raise UserError(f"cannot read --prompts-file {path} ({err.strerror})") from None
    except UnicodeDecodeError as err:
        raise UserError(
            f"--prompts-file {path} is not UTF-8 text ({err.reason} at byte {err.start})"
        ) from None


def run(args: argparse.Namespace) -> int:
    prompts = list(args.prompt)
    if args.prompts_file is not None:
        prompts += read_prompts(args.prompts_file)
    if not prompts:
        raise UserError("no prompts: pass --prompt TEXT (repeatable) or --prompts-file FILE")
    device = resolve_device(args.device, "--device")
    model, found = load_pretrained(args.model)
    tokenizer_path = args.tokenizer or found
    if tokenizer_path is None:
        raise UserError(
            f"no tokenizer found with {args.model}; pass --tokenizer PATH/tokenizer.json"
        )
    tokenizer = prepare_tokenizer(tokenizer_path, eos_token=args.eos_token)
    encoded = [tokenizer.encode(p) for p in prompts]
    if any(not ids for ids in encoded):
        raise UserError("a prompt encodes to no tokens; give every prompt some text")
    config = GenerationConfig(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        repetition_penalty=args.repetition_penalty,
        stop=tuple(args.stop),
        eos_token_id=tokenizer.eos_id,
        seed=args.seed,
    )
    model.to(device=device, dtype=WEIGHT_DTYPES[args.dtype])
    ids, mask = left_pad(encoded)
    out = generate(model, ids, mask, config, decode=tokenizer.decode, use_cache=not args.no_cache)
    for prompt, text, reason, error in zip(
        prompts, out.texts, out.finish_reasons, out.errors, strict=True
    ):
        print(f"--- prompt {prompt!r} ({reason}) ---")
        print(prompt + text if error is None else f"error: {error}")
    return 1 if any(out.errors) else 0


if __name__ == "__main__":
    sys.exit(main())

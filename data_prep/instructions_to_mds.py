"""Convert instruction data (.jsonl) to MDS rows for finetuning: only response tokens count.

Each line is {"prompt": ..., "response": ...} or {"messages": [{"role", "content"}, ...]}.
Inputs and --out may be local paths or fsspec URLs (s3://bucket/sft.jsonl). The tokenizer's
chat template is used when its folder has one, else the default format documented in
llmfoundry/data/prep/instructions.py. Train on it with `+experiment=finetune data.remote=OUT`.

Examples:
  # instruction pairs from this Python's standard library (the finetuning demo's data)
  python data_prep/instructions_to_mds.py --from-python-sources /usr/lib/python3.12 \\
      --tokenizer data/demo/mds/tokenizer.json --seq-len 256 --val-fraction 0.05 \\
      --out data/demo/sft

  python data_prep/instructions_to_mds.py chats.jsonl --tokenizer my-hf-tokenizer/ \\
      --seq-len 2048 --no-pack --too-long drop --out s3://bucket/sft
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from llmfoundry.data.prep.docstrings import write_docstring_examples
from llmfoundry.data.prep.instructions import TOO_LONG, instructions_to_mds
from llmfoundry.data.prep.interrupt import prep_script
from llmfoundry.utils import storage
from llmfoundry.utils.cli import add_script_arguments
from llmfoundry.utils.errors import UserError
from llmfoundry.utils.files import join_url, parse_size
from llmfoundry.utils.logs import configure_logging


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("inputs", nargs="*", help=".jsonl files (local paths or URLs)")
    parser.add_argument(
        "--from-python-sources",
        nargs="+",
        metavar="FOLDER",
        help="instead of inputs: make {prompt: signature, response: docstring} pairs from the "
        "*.py files under these folders (written to OUT/examples.jsonl)",
    )
    parser.add_argument("--out", required=True, help="output folder or fsspec URL")
    parser.add_argument(
        "--tokenizer",
        required=True,
        help="tokenizer.json, tokenizer folder, .model, .tiktoken or tiktoken:NAME",
    )
    parser.add_argument("--seq-len", type=int, required=True, help="tokens per row")
    parser.add_argument(
        "--no-pack", action="store_true", help="one example per padded row (default: pack)"
    )
    parser.add_argument(
        "--too-long",
        choices=TOO_LONG,
        default="truncate",
        help="what to do with examples longer than --seq-len (default truncate)",
    )
    parser.add_argument("--val-fraction", type=float, default=0.0, help="share of examples")
    parser.add_argument("--seed", type=int, default=17, help="seed of the train/val split")
    parser.add_argument("--eos-token", help="end-of-response token (default: the tokenizer's)")
    parser.add_argument("--size-limit", default="64mb", help="shard size limit (default 64mb)")
    parser.add_argument("--compression", help="zstd, gz, bz2, br or snappy (default none)")
    parser.add_argument(
        "--max-example-bytes",
        default="16mb",
        help="longest input line (one example) read, like 16mb (default); longer ones are refused",
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace output made from other inputs"
    )
    add_script_arguments(parser)
    args = parser.parse_args(argv)
    configure_logging()
    with prep_script(args):
        inputs = list(args.inputs)
        if args.from_python_sources:
            if inputs:
                raise UserError("give .jsonl inputs or --from-python-sources, not both")
            if not storage.is_local(args.out):
                raise UserError("--from-python-sources writes a local --out folder; give a path")
            Path(storage.local_path(args.out)).mkdir(parents=True, exist_ok=True)
            inputs = [join_url(args.out, "examples.jsonl")]
            write_docstring_examples(args.from_python_sources, inputs[0])
        meta = instructions_to_mds(
            inputs,
            args.out,
            args.tokenizer,
            args.seq_len,
            pack=not args.no_pack,
            too_long=args.too_long,
            val_fraction=args.val_fraction,
            seed=args.seed,
            eos_token=args.eos_token,
            size_limit=parse_size(args.size_limit),
            compression=args.compression,
            overwrite=args.overwrite,
            max_example_bytes=parse_size(args.max_example_bytes),
        )
    state = "up to date, reused" if meta["reused"] else "written"
    splits = ", ".join(f"{k}: {v['rows']:,} rows" for k, v in meta["splits"].items())
    print(
        f"{args.out}: {state}: {meta['examples']:,} examples -> {splits}; packing efficiency "
        f"{100 * meta['packing_efficiency']:.1f}%; truncated {meta['truncated']}, dropped "
        f"{meta['dropped_too_long']} too long, {meta['dropped_no_response']} without response"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

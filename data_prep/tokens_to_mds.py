"""Convert a token stream (from text_to_tokens.py) into MDS shards of fixed-length rows.

Writes <out>/train and <out>/val (each an MDS dataset with its own index.json), copies the
tokenizer to <out>/tokenizer.json and writes <out>/meta.json (seq_len, vocab_size, eos id,
and per split its tokens and the UTF-8 bytes of text they decode to, for bits per byte).
<out> may be a local folder or an fsspec URL such as s3://bucket/dataset.

Example:
  python data_prep/tokens_to_mds.py data/stdlib/tokens.bin --out data/stdlib/mds \\
      --seq-len 256 --val-fraction 0.05 --compression zstd --hashes xxh64

A token file made elsewhere (nanoGPT's train.bin) without a sidecar: add --dtype uint16
--vocab-size 50257 [--eos-id 50256], or describe it once with data_prep/adopt_tokens.py.
Its val.bin becomes the val split with --val-tokens data/owt/val.bin (the same facts apply).
"""

from __future__ import annotations

import argparse
import sys

from llmfoundry.data.prep import tokens_to_mds
from llmfoundry.data.prep.adopt import add_bare_token_arguments
from llmfoundry.data.prep.interrupt import prep_script
from llmfoundry.utils.cli import add_script_arguments
from llmfoundry.utils.files import parse_size
from llmfoundry.utils.logs import configure_logging


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("tokens", help="token file (.bin) or its .json sidecar")
    parser.add_argument("--out", required=True, help="output folder or fsspec URL")
    parser.add_argument("--seq-len", type=int, required=True, help="tokens per row")
    val = parser.add_mutually_exclusive_group()
    val.add_argument(
        "--val-fraction",
        type=float,
        default=0.0,
        help="fraction of rows (the stream's tail) for validation",
    )
    val.add_argument("--val-rows", type=int, help="number of validation rows (the stream's tail)")
    val.add_argument(
        "--val-tokens",
        help="a token file of its own for validation (nanoGPT's val.bin), all of it; the "
        "stream is then all training",
    )
    parser.add_argument(
        "--size-limit", default="64mb", help="shard size limit (bytes, or like 64mb; default 64mb)"
    )
    parser.add_argument(
        "--compression", help="zstd, zstd:LEVEL, gz, bz2, br or snappy (default none)"
    )
    parser.add_argument(
        "--hashes",
        nargs="*",
        default=["xxh64"],
        help="shard hashes to record (default xxh64; e.g. xxh64 sha1; none: --hashes with no names)",
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace existing output made from other inputs"
    )
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    add_bare_token_arguments(parser)
    add_script_arguments(parser)
    args = parser.parse_args(argv)
    configure_logging()
    with prep_script(args):
        meta = tokens_to_mds(
            args.tokens,
            args.out,
            args.seq_len,
            val_tokens=args.val_tokens,
            val_fraction=args.val_fraction,
            val_rows=args.val_rows,
            size_limit=parse_size(args.size_limit),
            compression=args.compression,
            hashes=args.hashes,
            overwrite=args.overwrite,
            progress=not args.no_progress,
            dtype=args.dtype,
            vocab_size=args.vocab_size,
            eos_id=args.eos_id,
        )
    state = "up to date, reused" if meta["reused"] else "written"
    splits = ", ".join(
        f"{k}: {v['rows']:,} rows in {v['shards']} shards" for k, v in meta["splits"].items()
    )
    print(
        f"{args.out}: {state}: {splits}; seq_len {meta['seq_len']}, {meta['encoding']}, dropped {meta['dropped_tokens']} tail tokens"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

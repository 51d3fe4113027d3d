"""Check or merge MDS datasets (local folders or fsspec URLs).

  verify DIR   read every shard as training would: stored size and hashes, decompression,
               raw hashes, headers, every sample, token ids < vocabulary (--vocab-size, or
               vocab_size from DIR/meta.json); prints a summary; exit status 1 on any problem.
               DIR may hold index.json, or sub-folders (train/, val/) that do.
  merge DIR    write DIR/index.json listing the shards of every sub-folder's index.json,
               basenames prefixed with the sub-folder (as mosaicml-streaming's merge_index).
  merge A B --out C
               write C/index.json listing the shards of folders A, B, ... in that order;
               a folder outside C is first copied to C/<its name> (an index names its
               shards relative to its own folder).

Examples:
  python data_prep/mds_tools.py verify data/stdlib/mds
  python data_prep/mds_tools.py merge s3://bucket/dataset
  python data_prep/mds_tools.py merge data/code/mds/train data/docs/mds/train --out data/mix
"""

from __future__ import annotations

import argparse
import sys

from llmfoundry.data.prep import merge_folders, merge_indexes, verify_mds
from llmfoundry.utils.cli import add_script_arguments, script_errors
from llmfoundry.utils.errors import UserError
from llmfoundry.utils.logs import configure_logging


def _verify(args: argparse.Namespace) -> int:
    reports = verify_mds(args.dir, vocab_size=args.vocab_size, allow_unsafe=args.allow_unsafe)
    failed = False
    for r in reports:
        status = "OK" if not r.errors else f"FAILED ({len(r.errors)} problems)"
        print(f"{r.index}: {status}")
        print(
            f"  shards {r.shards}, samples {r.samples:,}, raw {r.raw_bytes:,} B, stored {r.stored_bytes:,} B"
        )
        print(f"  columns {r.columns}")
        print(
            f"  compression {sorted(r.compression) or 'none'}, hashes {sorted(r.hashes) or 'none'}"
        )
        if r.tokens:
            print(f"  integer array values {r.tokens:,}, max {r.max_token}")
        for err in r.errors:
            print(f"  ERROR {err}")
        failed |= bool(r.errors)
    return 1 if failed else 0


def _merge(args: argparse.Namespace) -> int:
    if args.out is None and len(args.dirs) > 1:
        raise UserError(
            f"merge got {len(args.dirs)} folders but no --out: "
            "give the folder for the merged index.json with --out"
        )
    if args.out is not None and args.subfolders:
        raise UserError("--subfolders goes with one DIR; with --out, list the folders instead")
    if args.out is None:
        out = args.dirs[0]
        shards = merge_indexes(out, args.subfolders or None)
    else:
        out = args.out
        shards, copied = merge_folders(args.dirs, out)
        for folder in copied:
            print(f"copied {folder} into {out}")
    folders = list(dict.fromkeys(s.raw_basename.rsplit("/", 1)[0] for s in shards))
    samples = sum(s.samples for s in shards)
    print(f"{out}/index.json: {len(shards)} shards, {samples:,} samples from {folders}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    verify = sub.add_parser("verify", help="check every shard and print a summary")
    verify.add_argument("dir", help="dataset folder or fsspec URL")
    verify.add_argument("--vocab-size", type=int, help="token ids must be below this")
    verify.add_argument(
        "--allow-unsafe", action="store_true", help="also decode pickle (pkl) columns"
    )
    verify.set_defaults(func=_verify)
    merge = sub.add_parser(
        "merge", help="merge sub-folder indexes into DIR/index.json, or folders into --out"
    )
    merge.add_argument(
        "dirs",
        nargs="+",
        metavar="DIR",
        help="one folder or fsspec URL whose sub-folders hold index.json; with --out, "
        "the folders to merge",
    )
    merge.add_argument("--out", help="folder or fsspec URL for the merged index.json")
    merge.add_argument(
        "--subfolders", nargs="*", help="sub-folders to merge, in order (default: all, sorted)"
    )
    merge.set_defaults(func=_merge)
    for command in (verify, merge):
        add_script_arguments(command)
    args = parser.parse_args(argv)
    configure_logging()
    with script_errors(args):
        return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

"""Tokenize text into one token stream: a numpy memmap .bin plus a JSON sidecar.

Examples:
  # train a 8192-token byte-level BPE on Python sources and tokenize them
  python data_prep/text_to_tokens.py /usr/lib/python3.11 --glob '*.py' --exclude 'test*' \\
      --train-tokenizer --vocab-size 8192 --out data/stdlib/tokens.bin --workers 2

  # tokenize JSON lines / parquet / a saved Hugging Face dataset with an existing tokenizer
  python data_prep/text_to_tokens.py corpus.jsonl more.parquet --text-field text \\
      --tokenizer data/stdlib/tokenizer.json --out data/corpus/tokens.bin

Then convert to MDS with data_prep/tokens_to_mds.py.
"""

from __future__ import annotations

import argparse
import sys

from llmfoundry.data.prep import text_to_tokens
from llmfoundry.data.prep.interrupt import prep_script
from llmfoundry.utils.cli import add_script_arguments
from llmfoundry.utils.files import parse_size
from llmfoundry.utils.logs import configure_logging


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "sources",
        nargs="+",
        help="folders of text files, text files, .jsonl/.ndjson or .parquet files, folders "
        "saved with datasets' save_to_disk, or hf:NAME (datasets.load_dataset: local files, "
        "or the hub when online)",
    )
    parser.add_argument("--out", required=True, help="output token file, ending in .bin")
    tok = parser.add_argument_group("tokenizer (choose one)")
    tok.add_argument(
        "--tokenizer",
        help="tokenizer.json, a folder holding one / a transformers tokenizer, a SentencePiece "
        ".model, a tiktoken .tiktoken file or tiktoken:NAME (from tiktoken's cache)",
    )
    tok.add_argument(
        "--train-tokenizer",
        action="store_true",
        help="train a byte-level BPE (saved as tokenizer.json next to --out)",
    )
    tok.add_argument(
        "--vocab-size", type=int, default=8192, help="vocabulary size when training (default 8192)"
    )
    tok.add_argument(
        "--train-bytes", default="256mb", help="train on the first N bytes of text (default 256mb)"
    )
    tok.add_argument(
        "--eos-token", help="EOS token (default <|endoftext|>, or the tokenizer's eos_token)"
    )
    tok.add_argument("--bos-token", help="also put this token before every document")
    src = parser.add_argument_group("sources")
    src.add_argument(
        "--glob", action="append", help="file name pattern in folders (repeatable; default *.txt)"
    )
    src.add_argument(
        "--exclude",
        action="append",
        default=[],
        help="skip files whose name or relative path matches, and directories whose relative path matches (repeatable)",
    )
    src.add_argument(
        "--text-field",
        default="text",
        help="text field of jsonl/parquet/datasets rows (default text)",
    )
    src.add_argument(
        "--hf-split", default="train", help="split of a Hugging Face dataset (default train)"
    )
    src.add_argument("--hf-config", help="configuration name for hf:NAME")
    src.add_argument(
        "--max-bytes", help="stop after the document that reaches N bytes of text (e.g. 500mb)"
    )
    out = parser.add_argument_group("output")
    out.add_argument(
        "--doc-boundaries",
        action="store_true",
        help="also write <out>.docs.bin: int64 start offset of each document",
    )
    out.add_argument(
        "--workers",
        type=int,
        default=1,
        help="tokenizer processes (output is identical for any number)",
    )
    out.add_argument(
        "--overwrite",
        action="store_true",
        help="redo even if --out is up to date, or replace a different one",
    )
    out.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    add_script_arguments(parser)
    args = parser.parse_args(argv)
    configure_logging()
    with prep_script(args):
        meta = text_to_tokens(
            args.sources,
            args.out,
            tokenizer=args.tokenizer,
            train_tokenizer=args.train_tokenizer,
            vocab_size=args.vocab_size,
            train_bytes=parse_size(args.train_bytes),
            globs=args.glob or ["*.txt"],
            excludes=args.exclude,
            text_field=args.text_field,
            hf_split=args.hf_split,
            hf_config=args.hf_config,
            max_bytes=parse_size(args.max_bytes),
            eos_token=args.eos_token,
            bos_token=args.bos_token,
            doc_boundaries=args.doc_boundaries,
            workers=args.workers,
            overwrite=args.overwrite,
            progress=not args.no_progress,
        )
    state = "up to date, reused" if meta["reused"] else "written"
    print(
        f"{args.out}: {state}: {meta['num_tokens']:,} tokens ({meta['dtype']}), "
        f"{meta['num_documents']:,} documents, {meta['skipped_documents']:,} skipped, "
        f"vocab {meta['vocab_size']}, eos id {meta['eos_id']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

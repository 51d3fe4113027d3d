"""Describe token files made elsewhere (nanoGPT's train.bin / val.bin) once, so every later
command reads them like text_to_tokens.py output: writes x.json beside each x.bin.

A bare .bin does not say its dtype or vocabulary, and neither can be guessed safely (the
largest id in the file is only a lower bound of the vocabulary), so both are given here; every
id is checked against --vocab-size (one pass over the file, bounded memory). --eos-id, if
known, enables document masking (data.sequence_id_from_eos=auto). No tokenizer is needed.

Example (nanoGPT's GPT-2 tokens):
  python data_prep/adopt_tokens.py data/owt/train.bin data/owt/val.bin \\
      --dtype uint16 --vocab-size 50257 --eos-id 50256
"""

from __future__ import annotations

import argparse
import sys

from llmfoundry.data.prep.adopt import add_bare_token_arguments, adopt_tokens
from llmfoundry.data.prep.interrupt import prep_script
from llmfoundry.utils.cli import add_script_arguments


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("tokens", nargs="+", help="token files (.bin)")
    add_bare_token_arguments(parser, required=True)
    parser.add_argument("--bos-id", type=int, help="the start-of-document token id, if any")
    parser.add_argument(
        "--overwrite", action="store_true", help="replace a sidecar that says otherwise"
    )
    add_script_arguments(parser, storage=False)
    args = parser.parse_args(argv)
    with prep_script(args):
        for path in args.tokens:
            meta = adopt_tokens(
                path,
                dtype=args.dtype,
                vocab_size=args.vocab_size,
                eos_id=args.eos_id,
                bos_id=args.bos_id,
                overwrite=args.overwrite,
            )
            print(
                f"{path}: {meta['num_tokens']:,} {meta['dtype']} tokens, ids below {meta['vocab_size']}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())

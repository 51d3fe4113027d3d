"""Write the synthetic passkey-retrieval dataset (llmfoundry/data/passkey.py) as MDS.

Writes <out>/train, <out>/val, <out>/tokenizer.json and <out>/meta.json, so it trains like any
data_prep output and scripts/eval_passkey.py scores a checkpoint on its val split.

Example (rows of 128 tokens; train a model with an attention window of 32 on them):
  python data_prep/passkey.py --out data/passkey --seq-len 128 --train-rows 20000
  python scripts/train.py data.remote=data/passkey model.max_seq_len=128 ...
  python scripts/eval_passkey.py outputs/<run>/checkpoints --data data/passkey
"""

from __future__ import annotations

import argparse
import json
import sys

from llmfoundry.data.passkey import PasskeyTask, write_passkey_dataset
from llmfoundry.data.prep.interrupt import prep_script
from llmfoundry.utils.cli import add_script_arguments


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--seq-len", type=int, required=True, help="tokens per row")
    parser.add_argument("--n-digits", type=int, default=2, help="digits in the passkey (2)")
    parser.add_argument("--n-filler", type=int, default=16, help="filler words (16)")
    parser.add_argument("--train-rows", type=int, default=20000)
    parser.add_argument("--val-rows", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    add_script_arguments(parser)
    args = parser.parse_args(argv)
    with prep_script(args):
        task = PasskeyTask(args.seq_len, args.n_digits, args.n_filler)
        meta = write_passkey_dataset(args.out, task, args.train_rows, args.val_rows, args.seed)
    print(json.dumps(meta, indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())

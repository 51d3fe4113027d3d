"""Import a Hugging Face transformers MPT folder as a llmfoundry checkpoint, to finetune from.

    python scripts/import_hf.py HF_DIR CKPT_DIR
    python scripts/train.py model=<the same shape> load_path=CKPT_DIR \\
        load_ignore_keys=[optimizer,scaler,timestamp,algorithms,callbacks,loggers,data,rng]

CKPT_DIR becomes a save folder holding one weights-only checkpoint (ep0-ba0, named by
`latest`): the weights in float32, the model config (printed, for the training command) and the
folder's tokenizer.json. Config fields our MPT cannot represent are refused, naming the field.
The import is checked: the checkpoint's logits must equal the folder's (relative error at most
1e-5, printed).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from llmfoundry.models.mpt.hf import from_hf, logits_relative_error
from llmfoundry.models.mpt.pretrained import TOKENIZER_FILE, load_pretrained, save_weights

TOLERANCE = 1e-5


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("hf_dir", help="a transformers MPT folder (config.json and weights)")
    p.add_argument("ckpt_dir", help="save folder to write the checkpoint into (load_path=)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model = from_hf(args.hf_dir)
    tokenizer = Path(args.hf_dir, TOKENIZER_FILE)
    name = Path(args.hf_dir.rstrip("/")).name  # the served model's id (scripts/serve.py)
    url = save_weights(model, args.ckpt_dir, tokenizer if tokenizer.is_file() else None, name)
    overrides = " ".join(
        f"model.{k}={v}" for k, v in dataclasses.asdict(model.config).items() if v is not None
    )
    print(f"wrote {url}\nmodel config: {overrides}")
    loaded, _ = load_pretrained(args.ckpt_dir)
    error = logits_relative_error(loaded, args.hf_dir)
    print(f"round trip: logits relative error {error:.2e} (limit {TOLERANCE:.0e})")
    return 0 if error <= TOLERANCE else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (ValueError, FileNotFoundError) as err:  # bad input: the message says what to fix
        sys.exit(f"error: {err}")

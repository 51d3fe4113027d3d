"""Import a Hugging Face transformers folder (MPT or Llama) as a llmfoundry checkpoint, to finetune from.

    python scripts/import_hf.py HF_DIR CKPT_DIR
    python scripts/train.py <the printed model=... model.k=v overrides> load_path=CKPT_DIR \\
        load_ignore_keys=[optimizer,scaler,timestamp,algorithms,callbacks,loggers,data,rng]

The family comes from config.json's model_type (mpt: MptForCausalLM, llama: LlamaForCausalLM).
CKPT_DIR becomes a save folder holding one weights-only checkpoint (ep0-ba0, named by `latest`):
the weights in float32, the model config and the folder's tokenizer.json. The script prints the
overrides that make scripts/train.py build this exact model: the nearest conf/model size and the
fields that differ from it. Config fields our model cannot represent are refused, naming the
field. The import is checked: the checkpoint's logits must equal the folder's (relative error at
most 1e-5, printed).
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
from pathlib import Path
from typing import Any

from hydra.utils import instantiate
from omegaconf import OmegaConf

from llmfoundry.checkpoint import resolve
from llmfoundry.checkpoint.pretrained import (
    TOKENIZER_FILE,
    is_hf_folder,
    load_pretrained,
    save_weights,
)
from llmfoundry.config.preflight import compose_config
from llmfoundry.models.families import family_of, family_of_hf, logits_relative_error
from llmfoundry.utils.cli import add_script_arguments, script_errors
from llmfoundry.utils.errors import UserError

TOLERANCE = 1e-5
CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("hf_dir", help="a transformers MPT or Llama folder (config.json and weights)")
    p.add_argument("ckpt_dir", help="save folder to write the checkpoint into (load_path=)")
    add_script_arguments(p)
    return p.parse_args(argv)


def hydra_value(value: Any) -> str:
    """`value` as a Hydra command-line override writes it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{hydra_value(v)}" for k, v in value.items()) + "}"
    return str(value)


def train_overrides(config: Any, conf_dir: Path = CONF_DIR) -> list[str]:
    """``model=<size>`` and the ``model.k=v`` that make conf/ compose to exactly `config`: the
    family's conf/model size that needs the fewest overrides, and those."""
    family = family_of(config)
    ours = dataclasses.asdict(config)
    best: list[str] | None = None
    base = f"/model_base/{family.name}@_here_"
    for path in sorted((conf_dir / "model").glob("*.yaml")):
        if base not in (OmegaConf.load(path).get("defaults") or []):
            continue  # another family's size
        node = compose_config(conf_dir, [f"model={path.stem}"]).model
        theirs = dataclasses.asdict(instantiate(node))
        changed = [f"model.{k}={hydra_value(v)}" for k, v in ours.items() if theirs[k] != v]
        if best is None or len(changed) < len(best) - 1:
            best = [f"model={path.stem}", *changed]
    if best is None:
        raise UserError(f"conf/model has no {family.name} size to train this model from")
    return best


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with script_errors(args):
        return run(args)


def refuse_checkpoint(path: str) -> None:
    """A llmfoundry checkpoint given for the transformers folder: say what to do with it."""
    if is_hf_folder(path):
        return
    try:
        found = resolve(path)
    except UserError:
        return  # not a checkpoint either: family_of_hf says what is missing
    raise UserError(
        f"{path} is a llmfoundry checkpoint ({found}), not a transformers folder: train from it "
        "with load_path= as it is, or export it with scripts/export_hf.py"
    )


def run(args: argparse.Namespace) -> int:
    refuse_checkpoint(args.hf_dir)
    model = family_of_hf(args.hf_dir).from_hf(args.hf_dir)
    tokenizer = Path(args.hf_dir, TOKENIZER_FILE)
    name = Path(args.hf_dir.rstrip("/")).name  # the served model's id (scripts/serve.py)
    url = save_weights(model, args.ckpt_dir, tokenizer if tokenizer.is_file() else None, name)
    overrides = shlex.join(train_overrides(model.config))  # quoted for the shell: {a:1,b:2}
    load = shlex.quote(f"load_path={url}")
    print(f"wrote {url}\ntrain it with: python scripts/train.py {overrides} {load}")
    loaded, _ = load_pretrained(args.ckpt_dir)
    error = logits_relative_error(loaded, args.hf_dir)
    print(f"round trip: logits relative error {error:.2e} (limit {TOLERANCE:.0e})")
    return 0 if error <= TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(main())

"""Import a Hugging Face transformers folder (MPT, Llama, Qwen3 or Qwen2), or a Composer checkpoint of an llm-foundry MPT, as a llmfoundry checkpoint, to finetune from.

    python scripts/import_hf.py HF_DIR CKPT_DIR
    python scripts/import_hf.py ep0-ba4-rank0.pt CKPT_DIR   # Composer's (or its sharded folder)
    python scripts/train.py +experiment=finetune model=from_checkpoint load_path=CKPT_DIR/ep0-ba0 \\
        data.remote=data/demo/sft        # the command it prints; your data in data.remote

The family comes from config.json's model_type (mpt: MptForCausalLM, llama: LlamaForCausalLM,
qwen3: Qwen3ForCausalLM, qwen2: Qwen2ForCausalLM).
llm-foundry's MPT folders (its convert_composer_to_hf.py output, the mosaicml/mpt-* downloads:
MPTForCausalLM with auto_map) are read too, without running their code: config.json's
llm-foundry keys are mapped to ours or refused by name (llmfoundry/models/mpt/foundry.py).
CKPT_DIR becomes a save folder holding one weights-only checkpoint (ep0-ba0, named by `latest`):
the weights in float32, the model config and the folder's tokenizer.json. The script prints the
command that finetunes it (conf/experiment/finetune.yaml: weights only; `model=from_checkpoint`:
this model's config, read from the checkpoint), and warns when config.json's eos_token_id is not
the tokenizer's EOS. Config fields our model cannot represent are refused, naming the field. The
import is checked: the checkpoint's logits must equal the folder's (relative error at most 1e-5,
printed): transformers' model of the folder, or for llm-foundry's layout the folder as read here
(its equality with llm-foundry's own model: tests/models/test_mpt_foundry_folders.py). A Composer
checkpoint brings its weights, the model config llm-foundry recorded in it and its tokenizer
(llmfoundry/checkpoint/composer.py); its check compares the written checkpoint's logits with the
Composer checkpoint's model. (To continue its run rather than finetune, give it to train.py as
load_path= directly.)
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

import torch

from llmfoundry.checkpoint import locate
from llmfoundry.checkpoint.formats import ComposerFormat
from llmfoundry.checkpoint.pretrained import (
    TOKENIZER_FILE,
    is_hf_folder,
    load_pretrained,
    read_pretrained,
    save_weights,
)
from llmfoundry.models.families import family_of_hf, logits_relative_error
from llmfoundry.tokenizers.tokenizer import prepare_tokenizer
from llmfoundry.utils.cli import add_script_arguments, script_errors
from llmfoundry.utils.errors import UserError

TOLERANCE = 1e-5
FINETUNE_DATA = "data/demo/sft"  # the recipe's: data_prep/instructions_to_mds.py's output


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "hf_dir",
        help="a transformers MPT, Llama, Qwen3 or Qwen2 folder, or llm-foundry's MPT (config.json and "
        "weights), or a Composer checkpoint (ep<E>-ba<B>-rank0.pt or its sharded folder)",
    )
    p.add_argument("ckpt_dir", help="save folder to write the checkpoint into (load_path=)")
    add_script_arguments(p)
    return p.parse_args(argv)


def train_command(url: str) -> str:
    """The command that finetunes the checkpoint at `url` as printed: the recipe loads its
    weights only, and `model=from_checkpoint` takes its model config from it."""
    args = ["+experiment=finetune", "model=from_checkpoint", f"load_path={url}"]
    return shlex.join(["python", "scripts/train.py", *args, f"data.remote={FINETUNE_DATA}"])


def warn_eos_mismatch(hf_dir: str, tokenizer: Path) -> None:
    """One line when config.json's eos_token_id is not the tokenizer's EOS: training, serving
    and export stop at the tokenizer's (`prepare_tokenizer`), transformers' generate at the
    config's."""
    config = json.loads(Path(hf_dir, "config.json").read_text(encoding="utf-8"))
    ids = config.get("eos_token_id")
    ids = ids if isinstance(ids, list) else [ids]
    prepared = prepare_tokenizer(tokenizer, require_eos=False)
    if prepared.eos_id is not None and ids != [None] and prepared.eos_id not in ids:
        print(
            f"warning: {hf_dir}/config.json's eos_token_id {config['eos_token_id']} is not the "
            f"tokenizer's EOS id {prepared.eos_id} ({prepared.eos_token}); llmfoundry uses the "
            "tokenizer's (--eos-token in the scripts picks another)",
            file=sys.stderr,
        )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with script_errors(args):
        return run(args)


def is_composer_checkpoint(path: str) -> bool:
    """Whether `path` is a Composer checkpoint; a llmfoundry checkpoint given for the
    transformers folder is refused, saying what to do with it."""
    if is_hf_folder(path):
        return False
    try:
        found = locate(path)
    except UserError:
        return False  # not a checkpoint either: family_of_hf says what is missing
    if isinstance(found.format, ComposerFormat):
        return True
    raise UserError(
        f"{path} is a llmfoundry checkpoint ({found.location}), not a transformers folder: "
        "train from it with load_path= as it is, or export it with scripts/export_hf.py"
    )


def import_composer(args: argparse.Namespace) -> int:
    """Write the Composer checkpoint `args.hf_dir` as a weights-only checkpoint; check it."""
    composer = read_pretrained(args.hf_dir)
    tokenizer = None if composer.tokenizer is None else Path(composer.tokenizer, TOKENIZER_FILE)
    url = save_weights(composer.model, args.ckpt_dir, tokenizer, composer.run_name)
    print(f"wrote {url}\nfinetune it with: {train_command(url)}")
    loaded, _ = load_pretrained(args.ckpt_dir)
    error = logits_relative_error_between(loaded, composer.model)
    print(f"round trip: logits relative error {error:.2e} (limit {TOLERANCE:.0e})")
    return 0 if error <= TOLERANCE else 1


def logits_relative_error_between(ours: torch.nn.Module, theirs: torch.nn.Module) -> float:
    """max |ours - theirs| / max |theirs| of the two models' logits on the same tokens."""
    ids = torch.randint(
        0, ours.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        a, b = ours(ids).float(), theirs(ids).float()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def run(args: argparse.Namespace) -> int:
    if is_composer_checkpoint(args.hf_dir):
        return import_composer(args)
    model = family_of_hf(args.hf_dir).from_hf(args.hf_dir)
    tokenizer = Path(args.hf_dir, TOKENIZER_FILE)
    name = Path(args.hf_dir.rstrip("/")).name  # the served model's id (scripts/serve.py)
    url = save_weights(model, args.ckpt_dir, tokenizer if tokenizer.is_file() else None, name)
    if tokenizer.is_file():
        warn_eos_mismatch(args.hf_dir, tokenizer)
    print(f"wrote {url}\nfinetune it with: {train_command(url)}")
    loaded, _ = load_pretrained(args.ckpt_dir)
    error = logits_relative_error(loaded, args.hf_dir)
    print(f"round trip: logits relative error {error:.2e} (limit {TOLERANCE:.0e})")
    return 0 if error <= TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(main())

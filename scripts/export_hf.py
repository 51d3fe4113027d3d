"""Export a checkpoint as a Hugging Face transformers folder (weights, config, tokenizer).

    python scripts/export_hf.py outputs/run/checkpoints OUT_DIR            # the latest checkpoint
    python scripts/export_hf.py outputs/run/checkpoints/ep0-ba300 OUT_DIR --dtype bf16
    python scripts/export_hf.py s3://bucket/run/checkpoints OUT_DIR \
        --storage '{options: {endpoint_url: http://localhost:9000}}'

The checkpoint may be full (model.safetensors) or sharded (strategy=fsdp: its shards are merged
in this process, no GPU or process group needed), in a local folder or on an object store
(--storage: the training config's storage: block).

OUT_DIR then loads without trust_remote_code:
    transformers.AutoModelForCausalLM.from_pretrained(OUT_DIR)   # MptForCausalLM, LlamaForCausalLM
    transformers.AutoTokenizer.from_pretrained(OUT_DIR)

The tokenizer is the checkpoint's own tokenizer.json or the one its run trained with
(`tokenizer=`); --tokenizer overrides both. A checkpoint finetuned in the default finetune format
(data_prep/instructions_to_mds.py without a chat template) exports that format as the tokenizer's
`chat_template`, so chat through transformers, vLLM or scripts/serve.py prompts it as it trained.
The checkpoint's model family (its recorded config) picks the transformers class. An MPT that
class cannot hold (biases, learned positions, RoPE, grouped key/value heads, RMSNorm, GLU, an
untied head, qk_ln, a sliding window) is written in llm-foundry's layout instead, as its
convert_composer_to_hf.py and the mosaicml/mpt-* models have it (MPTForCausalLM, its config
keys), without its remote code: a printed line says how to load it. --layout transformers or
foundry insists on one (what it cannot hold is refused, naming the field). An fp32 export is
checked: the folder's logits must equal the checkpoint's (relative error at most 1e-5, printed).

    python scripts/export_hf.py their/ep0-ba4-rank0.pt OUT_DIR --layout foundry
"""

from __future__ import annotations

import argparse
import sys

from llmfoundry.checkpoint.pretrained import WEIGHT_DTYPES, read_pretrained
from llmfoundry.models.families import family_of, logits_relative_error
from llmfoundry.models.hf_folder import hf_tokenizer
from llmfoundry.utils.cli import add_script_arguments, script_errors
from llmfoundry.utils.errors import UserError

TOLERANCE = 1e-5


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "checkpoint",
        help="checkpoint folder, a save folder (its latest), or a Composer checkpoint (*-rank0.pt "
        "or its sharded folder)",
    )
    p.add_argument("out_dir", help="folder to write the transformers model into")
    p.add_argument(
        "--dtype", choices=WEIGHT_DTYPES, default="fp32", help="weights' dtype (default fp32)"
    )
    p.add_argument("--tokenizer", help="tokenizer.json or tokenizer folder (default: found)")
    p.add_argument("--eos-token", help="EOS token (default <|endoftext|> when it exists)")
    p.add_argument(
        "--layout",
        choices=("auto", "transformers", "foundry"),
        default="auto",
        help="transformers' own class, llm-foundry's MPT layout, or (auto, the default) "
        "transformers' where it holds the model, else llm-foundry's",
    )
    add_script_arguments(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with script_errors(args):
        return export(args)


def export(args: argparse.Namespace) -> int:
    loaded = read_pretrained(args.checkpoint)
    model, found = loaded.model, loaded.tokenizer
    family = family_of(model)
    layout = family.export_layout(model.config, args.layout)  # refuses before any work
    tokenizer_path = args.tokenizer or found
    if tokenizer_path is None:
        raise UserError(
            f"no tokenizer found with {args.checkpoint} (no tokenizer.json in the checkpoint and "
            "no tokenizer recorded by its run); pass --tokenizer PATH/tokenizer.json"
        )
    tokenizer = hf_tokenizer(tokenizer_path, args.eos_token, loaded.chat_template)
    family.export_to_hf(
        model,
        args.out_dir,
        tokenizer=tokenizer,
        dtype=WEIGHT_DTYPES[args.dtype],
        layout=layout,
    )
    chat = ", the default finetune format's chat template" if loaded.chat_template else ""
    print(f"wrote {args.out_dir} ({args.dtype}, tokenizer {tokenizer_path}{chat})")
    if note := family.layout_note(layout):
        print(f"{args.out_dir} is {note}")
    if args.dtype == "fp32":
        error = logits_relative_error(model, args.out_dir)
        print(f"round trip: logits relative error {error:.2e} (limit {TOLERANCE:.0e})")
        if error > TOLERANCE:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Make the inputs an llm-foundry YAML names in forms we train on (`Prep` steps), before the
run: a transformers folder imported as a weights-only checkpoint, a .jsonl of instructions
converted to instruction rows. Each is made once: a later launch finds it and reuses it."""

from __future__ import annotations

from pathlib import Path

from llmfoundry.config.foundry.native import Prep


def make(step: Prep) -> None:
    """Make `step`'s target (torch and transformers are imported only here)."""
    if step.kind == "import_hf":
        _import_hf(step)
    elif step.kind == "instructions":
        from llmfoundry.data.prep.instructions import instructions_to_mds

        options = step.options
        instructions_to_mds(
            [step.source],
            step.target,
            options["tokenizer"],
            int(options["seq_len"]),
            pack="no_pack" not in options,
        )
    else:
        raise ValueError(f"unknown preparation {step.kind!r}")


def _import_hf(step: Prep) -> None:
    """scripts/import_hf.py's import, skipped when the target already holds it."""
    from llmfoundry.checkpoint import resolve
    from llmfoundry.checkpoint.pretrained import TOKENIZER_FILE, save_weights
    from llmfoundry.models.families import family_of_hf
    from llmfoundry.utils.errors import UserError

    try:
        resolve(step.target)
        return
    except UserError:
        pass
    model = family_of_hf(step.source).from_hf(step.source)
    tokenizer = Path(step.source, TOKENIZER_FILE)
    name = Path(step.source.rstrip("/")).name
    save_weights(model, step.target, tokenizer if tokenizer.is_file() else None, name)

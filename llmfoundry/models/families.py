"""The model families, by name: each one's `ModelFamily` (its spec.py), and how to find the
family of a config, a recorded config, a model or a transformers folder."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import nn

from llmfoundry.models.family import ModelFamily
from llmfoundry.models.hf_config import CONFIG_FILE, read_config_json
from llmfoundry.models.llama.spec import LLAMA
from llmfoundry.models.mixtral.spec import MIXTRAL
from llmfoundry.models.mpt.spec import MPT
from llmfoundry.models.qwen3_moe.spec import QWEN3_MOE
from llmfoundry.utils.errors import UserError

FAMILIES: dict[str, ModelFamily] = {
    "mpt": MPT,
    "llama": LLAMA,
    "qwen3_moe": QWEN3_MOE,
    "mixtral": MIXTRAL,
}
# A model config recorded without a _target_ (checkpoints older than the families) is MPT.
DEFAULT = MPT


def _known() -> str:
    return ", ".join(f.config_target for f in FAMILIES.values())


def find_family(config_or_model: Any) -> ModelFamily | None:
    """The family of a config object or a model (by class); None for your own module."""
    for family in FAMILIES.values():
        if isinstance(config_or_model, family.config_class | family.model_class):
            return family
    return None


def family_of(config_or_model: Any) -> ModelFamily:
    """The family of a config object or a model (by class)."""
    if (family := find_family(config_or_model)) is not None:
        return family
    raise UserError(
        f"{type(config_or_model).__name__} belongs to no model family (known configs: "
        f"{_known()}); add the family's spec.py to llmfoundry/models/families.py"
    )


def family_of_target(target: str | None) -> ModelFamily:
    """The family whose config is `target` (a model config's ``_target_``; None: MPT)."""
    if target is None:
        return DEFAULT
    for family in FAMILIES.values():
        if family.config_target == target:
            return family
    raise UserError(f"model _target_ {target!r} is no model family's config; use one of {_known()}")


def config_from_record(fields: Mapping[str, Any], **overrides: Any) -> Any:
    """The config object a run recorded (`config.model` of a checkpoint), fields overridden."""
    family = family_of_target(fields.get("_target_"))
    return family.config_from({**fields, **family.load_overrides, **overrides})


def family_of_hf(hf_dir: str | Path) -> ModelFamily:
    """The family of the transformers folder `hf_dir`, by its config.json's ``model_type``."""
    path = Path(hf_dir, CONFIG_FILE)
    model_type = read_config_json(hf_dir).get("model_type")
    for family in FAMILIES.values():
        if family.hf_model_type == model_type:
            return family
    known = ", ".join(repr(f.hf_model_type) for f in FAMILIES.values())
    raise UserError(f"{path}: model_type {model_type!r} is not supported; supported: {known}")


def config_from_foundry(
    config: Mapping[str, Any], *, where: str = "model", weights_loaded: bool = False
) -> dict[str, Any]:
    """Our model config node (`model=`'s: fields and ``_target_``) for llm-foundry's MPT config
    dict (a train YAML's `mpt_causal_lm` block, an llm-foundry or Hub config.json, a Composer
    checkpoint's HF config): `llmfoundry.models.mpt.foundry.mpt_config_from_foundry`, which
    refuses in one line, naming `where`.key, what our MPT does not compute as llm-foundry's."""
    return MPT.foundry_config(config, where=where, weights_loaded=weights_loaded)


def build_model(config: Any, **overrides: Any) -> nn.Module:
    """The model of `config`'s family (fields replaced by `overrides`, e.g. init_device)."""
    return family_of(config).build(config, **overrides)


def logits_relative_error(model: nn.Module, hf_dir: str | Path) -> float:
    """max |ours - theirs| / max |theirs| of `model` against the transformers folder `hf_dir`
    (any family: transformers' AutoModelForCausalLM reads the folder, or the family's own
    reading of it where transformers would have to run the folder's code: `hf_reference`)."""
    from llmfoundry.models.hf_folder import logits_relative_error as relative_error

    return relative_error(model, hf_dir, family_of_hf(hf_dir).hf_reference(hf_dir))

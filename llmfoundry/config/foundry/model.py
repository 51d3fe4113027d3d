"""llm-foundry's model and tokenizer sections as our model group and tokenizer.

`mpt_causal_lm`: every MPT key llm-foundry reads, its defaults included (theirs are not ours:
learned positions and biases, no ALiBi), as our MPT config's fields (`config_from_foundry`,
which refuses what our MPT does not compute).
`hf_causal_lm` with a local transformers folder (any family's: MPT, Llama, Qwen3-MoE,
Mixtral): imported before the run as a weights-only checkpoint (scripts/import_hf.py's import,
`Prep`) that the run starts from, its model config read from that checkpoint
(`model=from_checkpoint`).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from llmfoundry.checkpoint.keys import WEIGHTS_ONLY
from llmfoundry.config.foundry.common import check_known, refuse, section
from llmfoundry.config.foundry.native import Native, Prep, Whole
from llmfoundry.utils.errors import UserError

_HF_KEYS = {
    "name",
    "pretrained_model_name_or_path",
    "pretrained",
    "init_device",
    "use_auth_token",
    "trust_remote_code",
    "use_flash_attention_2",
    "config_overrides",
    "loss_fn",
}
# A conf/model option of each family (its fields are all set over it).
_SIZE_OPTION = {
    "mpt": "mpt-tiny",
    "llama": "llama-tiny",
    "qwen3": "qwen3-tiny",
    "qwen2": "qwen2.5-0.5b",
    "qwen3_moe": "qwen3-moe-tiny",
    "mixtral": "mixtral-tiny",
}
# A transformers config's context-length keys (MPT, Llama and GPT-2 style).
_LENGTH_KEYS = ("max_seq_len", "max_position_embeddings", "n_positions")
_REFUSED_MODELS = {
    "hf_t5": "encoder-decoder (T5) models are not supported here; decoder-only MPT and Llama are",
}


def model(cfg: Mapping[str, Any], out: Native, prep_root: str) -> None:
    node = section(cfg, "model")
    name = node.pop("name", None)
    if name in _REFUSED_MODELS:
        raise refuse("model.name", _REFUSED_MODELS[name])
    if node.get("peft_config") is not None:
        raise refuse(
            "model.peft_config", "LoRA/PEFT adapters are not supported; finetune all weights"
        )
    if name == "mpt_causal_lm":
        # Imported here: it loads torch (models/norms.py), which the other checks do without.
        from llmfoundry.models.families import config_from_foundry

        out.groups["model"] = "mpt-tiny"  # every field is set below
        try:
            fields = config_from_foundry(node, where="model", weights_loaded=_loads(cfg))
        except UserError as err:
            raise UserError(f"llm-foundry key {err}") from None
        for key, value in fields.items():
            if key != "_target_":
                out.set(f"model.{key}", value)
        if "attn_uses_sequence_id" in (node.get("attn_config") or {}):
            out.note(
                "model.attn_config.attn_uses_sequence_id",
                "attention is masked per document whenever rows carry sequence_id (packed "
                "instruction rows do; data.sequence_id_from_eos for text)",
            )
    elif name == "hf_causal_lm":
        _hf_causal_lm(node, cfg, out, prep_root)
    else:
        raise refuse("model.name", f"{name!r}: mpt_causal_lm and hf_causal_lm are supported")


def _loads(cfg: Mapping[str, Any]) -> bool:
    """Whether the run starts from a checkpoint's weights (no init runs)."""
    return bool(cfg.get("load_path")) or bool(cfg.get("autoresume"))


def _hf_causal_lm(
    node: dict[str, Any], cfg: Mapping[str, Any], out: Native, prep_root: str
) -> None:
    check_known("model", node, _HF_KEYS)
    folder = node.get("pretrained_model_name_or_path")
    if not isinstance(folder, str) or not os.path.isfile(os.path.join(folder, "config.json")):
        raise refuse(
            "model.pretrained_model_name_or_path",
            f"{folder!r} is not a local transformers folder (config.json), and nothing is "
            "downloaded from the Hub here; download it (huggingface-cli download NAME "
            "--local-dir DIR) and give DIR",
        )
    _check_family(folder)
    _config_overrides(folder, dict(node.get("config_overrides") or {}), out)
    if node.get("trust_remote_code"):
        out.note("model.trust_remote_code", "the folder is read without running its code")
    for key in ("use_auth_token", "use_flash_attention_2", "loss_fn", "init_device"):
        if key in node:
            out.note(f"model.{key}", "not needed: local weights, torch attention, one loss")
    if not node.get("pretrained", True):
        _architecture_of(folder, out)
        return
    if cfg.get("load_path"):
        raise refuse(
            "load_path",
            "with hf_causal_lm the run starts from the folder's weights; give one of them",
        )
    folder = os.path.abspath(folder)
    digest = hashlib.sha256(folder.encode()).hexdigest()[:16]
    target = str(Path(prep_root, f"hf-import-{digest}"))
    out.prep.append(Prep("import_hf", folder, target))
    out.groups["model"] = "from_checkpoint"
    out.set("load_path", target)
    out.set("load_ignore_keys", list(WEIGHTS_ONLY))


def _architecture_of(folder: str, out: Native) -> None:
    """`pretrained: false`: the folder's architecture (config.json alone, no weights read) as
    our model group's fields, trained from our init."""
    import importlib

    from llmfoundry.models.families import config_from_foundry, family_of_hf
    from llmfoundry.models.hf_config import read_config_json
    from llmfoundry.models.hf_folder import read_hf_config

    family = family_of_hf(folder)
    if family.name == "mpt":  # llm-foundry's and the Hub's MPT config.json (auto_map) too
        fields = config_from_foundry(read_config_json(folder), where="config.json")
    else:
        adapter = importlib.import_module(family.hf_adapter)
        fields = family.recorded_config(adapter.from_hf_config(read_hf_config(folder, ())))
    out.groups["model"] = _SIZE_OPTION[family.name]  # every field is set below
    for key, value in fields.items():
        if key != "_target_":
            out.set(f"model.{key}", Whole(value) if isinstance(value, dict) else value)


def _config_overrides(folder: str, overrides: dict[str, Any], out: Native) -> None:
    """The published recipes' overrides of the folder's config.json: the attention kernel and
    sequence-id switch (notes: ours picks its kernel and masks by the data), and a context
    length up to the folder's (rows are max_seq_len long; the model keeps its own limit).
    Anything else would change the model the weights were trained as: refused."""
    from llmfoundry.models.hf_config import read_config_json

    where = "model.config_overrides"
    attn = dict(overrides.pop("attn_config", None) or {})
    check_known(f"{where}.attn_config", attn, {"attn_impl", "attn_uses_sequence_id"})
    for key in attn:
        out.note(f"{where}.attn_config.{key}", "the kernel is sdpa; documents are masked by data")
    folder_cfg = read_config_json(folder)
    for key, value in overrides.items():
        lengths = [folder_cfg[k] for k in _LENGTH_KEYS if k in folder_cfg]
        limit = lengths[0] if key in _LENGTH_KEYS and lengths else None
        if limit is None or not isinstance(value, int) or value > limit:
            raise refuse(
                f"{where}.{key}",
                f"{value!r}: the folder's config.json is taken as it is (a context length "
                "up to its own is accepted); edit config.json, or set max_seq_len",
            )
        out.note(f"{where}.{key}", f"rows are max_seq_len long; the model's limit stays {limit}")


def _check_family(folder: str) -> None:
    """Refuse a folder of a family we do not have (gpt2, opt, dbrx, ...) before anything runs;
    the registry (models/families.py, which imports torch) is asked only for such a YAML."""
    from llmfoundry.models.families import family_of_hf

    try:
        family_of_hf(folder)
    except UserError as err:
        raise refuse("model.pretrained_model_name_or_path", str(err)) from None


def tokenizer(cfg: Mapping[str, Any], out: Native) -> None:
    """Their {name, kwargs} as our tokenizer path: a local tokenizer.json or folder."""
    node = section(cfg, "tokenizer")
    check_known("tokenizer", node, {"name", "kwargs"})
    name = node.get("name")
    if not isinstance(name, str) or not os.path.exists(name):
        raise refuse(
            "tokenizer.name",
            f"{name!r} is not a local tokenizer.json or tokenizer folder, and nothing is "
            "downloaded from the Hub here; save it (AutoTokenizer.from_pretrained(NAME)"
            ".save_pretrained(DIR)) and give tokenizer.name=DIR",
        )
    kwargs = dict(node.get("kwargs") or {})
    check_known("tokenizer.kwargs", kwargs, {"model_max_length", "trust_remote_code"})
    if "model_max_length" in kwargs:
        out.note("tokenizer.kwargs.model_max_length", "rows are max_seq_len long here")
    if kwargs.get("trust_remote_code"):
        out.note("tokenizer.kwargs.trust_remote_code", "tokenizers are read without running code")
    out.set("tokenizer", name)

"""What the code outside a model family asks of it: one `ModelFamily` per family (its spec.py).

Build, resume checks, pretrained loading, HF import/export, planning and decoding take the
family from the model config (`family_of`: its class, or the ``_target_`` a run recorded) and
ask the spec; none of them names a family. A third family writes its ``spec.py`` and adds one
line to `llmfoundry.models.families.FAMILIES`.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from llmfoundry.models.plan import ParallelPlan
from llmfoundry.utils.errors import UserError


class CausalLM(Protocol):
    """What decoding (models/generation.py, the serving engine) needs of a family's model:
    its `config` (vocab_size, n_layers, max_seq_len, read through its family's spec), the token
    embedding `transformer.wte` (where the model lives), and a forward over new tokens that
    reads and extends a `KVCache` (models/layers/kv_cache.py)."""

    config: Any
    transformer: nn.Module

    def __call__(
        self, input_ids: torch.Tensor, sequence_id: torch.Tensor | None = ..., cache: Any = ...
    ) -> torch.Tensor: ...

    def eval(self) -> nn.Module: ...

    def train(self, mode: bool = ...) -> nn.Module: ...


@dataclass(frozen=True)
class ModelFamily:
    """One model family's answers.

    - `config_target`: the ``_target_`` of its conf/model nodes and of the model config a
      checkpoint records; `config_class` / `model_class`: built from it.
    - `parallelize`: its `ParallelPlan` (blocks to shard and recompute).
    - `hf_model_type`: transformers' ``model_type`` in config.json; `hf_adapter`: the module
      (imported only when an HF folder is read or written, as it imports transformers) with
      `from_hf(folder)`, `export_to_hf(model, out_dir, tokenizer=, dtype=, eos_token=)` and
      `to_hf_config(config)`, which refuses, before any work, what transformers' class cannot
      represent (`export_layout`); optionally `reference_model(folder)`: the model an import is
      checked against where transformers' own class cannot run the folder (None where it can),
      and `export_layout(config, layout)`: the folder layouts it writes besides transformers'
      (MPT: llm-foundry's, for what transformers' class cannot hold), `export_to_hf` taking
      `layout=`, and `LAYOUT_NOTES`: for such a layout, how to load it (printed on export).
    - `architecture`: model config keys a resume must match (the weights would not fit, or
      would mean something else).
    - `activation_bytes(config, precision)`: bytes autograd keeps per token per block for the
      backward ("fp32", "amp_bf16", "amp_fp16"), for the memory planner (llmfoundry/planning.py);
      a mixture of experts' layer left out (the planner counts it from its MoESpec: it is not
      split by tp as the rest of a block is).
    - `load_overrides`: config fields set when a checkpoint is loaded for inference (eager).
    - `position_limit(config)`: the longest sequence decoding may reach (a learned position
      table), None for no limit; `recurrent_memory(config)`: whether decoding keeps a
      compressed memory instead of a key/value cache (rows cannot be padded or batched);
      `attention_window(config)`: how far back one token's attention reaches in a forward
      (infini-attention's segment, a sliding window), None for the whole row.
    - `foundry_config(config, where=, weights_loaded=)`: our model config node for the model
      config dict of llm-foundry's model of this family (None: it has none we read).
    """

    name: str
    config_target: str
    config_class: type
    model_class: type[nn.Module]
    parallelize: Callable[[Any], ParallelPlan]
    hf_model_type: str
    hf_adapter: str
    architecture: tuple[str, ...]
    activation_bytes: Callable[[Any, str], int]
    load_overrides: Mapping[str, Any] = field(default_factory=dict)
    position_limit: Callable[[Any], int | None] = lambda config: None
    recurrent_memory: Callable[[Any], bool] = lambda config: False
    attention_window: Callable[[Any], int | None] = lambda config: None
    foundry_config: Callable[..., dict[str, Any]] | None = None

    def from_hf(self, hf_dir: str | Path) -> nn.Module:
        return importlib.import_module(self.hf_adapter).from_hf(hf_dir)

    def export_to_hf(
        self, model: nn.Module, out_dir: str | Path, layout: str = "auto", **kwargs: Any
    ) -> Path:
        """Write `model` as an HF folder in `layout` (`export_layout`)."""
        adapter = importlib.import_module(self.hf_adapter)
        if hasattr(adapter, "export_layout"):
            kwargs["layout"] = layout
        else:
            self.export_layout(model.config, layout)
        return adapter.export_to_hf(model, out_dir, **kwargs)

    def hf_reference(self, hf_dir: str | Path) -> nn.Module | None:
        """What import checks ours against: None for transformers' class of the folder."""
        adapter = importlib.import_module(self.hf_adapter)
        return getattr(adapter, "reference_model", lambda folder: None)(hf_dir)

    def export_layout(self, config: Any, layout: str = "auto") -> str:
        """The folder layout an export of `config` writes for `layout` ("auto",
        "transformers" or "foundry": llm-foundry's); refuses, before any work, a layout that
        cannot hold the model."""
        adapter = importlib.import_module(self.hf_adapter)
        if hasattr(adapter, "export_layout"):
            return adapter.export_layout(config, layout)
        if layout not in ("auto", "transformers"):
            raise UserError(
                f"layout {layout!r}: a {self.name} model exports as transformers' own class; "
                "use layout transformers (or auto)"
            )
        adapter.to_hf_config(config)
        return "transformers"

    def layout_note(self, layout: str) -> str | None:
        """What a reader of a folder in `layout` needs to know to load it (the adapter's
        LAYOUT_NOTES), None for transformers' own class (AutoModelForCausalLM loads it)."""
        notes = getattr(importlib.import_module(self.hf_adapter), "LAYOUT_NOTES", {})
        return notes.get(layout)

    def build(self, config: Any, **overrides: Any) -> nn.Module:
        """A model of this family from `config` (any field replaced by `overrides`)."""
        return self.model_class(dataclasses.replace(config, **overrides))

    def config_from(self, fields: Mapping[str, Any]) -> Any:
        """The config object from recorded `fields` (``_target_`` dropped)."""
        return self.config_class(**{k: v for k, v in fields.items() if k != "_target_"})

    def recorded_config(self, config: Any) -> dict[str, Any]:
        """`config` as a checkpoint records it (`config_from` reads it back)."""
        return {"_target_": self.config_target, **dataclasses.asdict(config)}

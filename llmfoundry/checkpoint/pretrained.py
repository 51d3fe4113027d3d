"""A trained model (any family) for generation, export or finetuning: from our checkpoint or a transformers folder.

`load_pretrained(path)` takes either
- a checkpoint written by training or by scripts/import_hf.py (a checkpoint folder, or a save
  folder whose `latest` one is read, on any filesystem fsspec reaches), full or sharded (its
  shards merged in this process): its weights and the model config its run recorded
  (`config.model` in state.pt, whose ``_target_`` names the family);
- a Composer checkpoint of an llm-foundry MPT (monolithic ``*-rank0.pt`` or its sharded
  folder): its weights, the llm-foundry config and tokenizer it carries (composer.py);
- a transformers folder (config.json + weights) of a family's ``model_type`` (mpt, llama),
  converted by that family's `from_hf`;
and returns the model with where its tokenizer is: the folder's own tokenizer, a checkpoint's
`tokenizer.json`, or the `tokenizer` setting of the run that wrote the checkpoint.
`read_pretrained(path)` also gives the name of that run (`run_name` in the checkpoint's
recorded config), which a server uses as the model's id, and the chat template of the format
its run finetuned in (`trained_chat_template`), which a server and an export use for chat.

`save_weights(model, folder)` writes the other direction: a checkpoint that holds only weights
(and the model config and tokenizer), for `load_path=` with weights-only loading
(`load_ignore_keys` = `llmfoundry.checkpoint.WEIGHTS_ONLY`).
"""

from __future__ import annotations

import dataclasses
import functools
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from llmfoundry.checkpoint.catalogue import MODEL_FILE, STATE_FILE, checkpoint_name
from llmfoundry.checkpoint.finite import refuse_non_finite
from llmfoundry.checkpoint.formats import locate
from llmfoundry.checkpoint.ours import TOKENIZER_FILE
from llmfoundry.checkpoint.state_dict import FORMAT_VERSION, model_weights
from llmfoundry.checkpoint.writer import write_checkpoint, write_object, write_tensors
from llmfoundry.data.prep.instructions import trained_chat_template
from llmfoundry.models.families import family_of, family_of_hf
from llmfoundry.utils.errors import UserError

# The --dtype choices of the scripts that load or export a model.
WEIGHT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def is_hf_folder(path: str | Path) -> bool:
    """Whether `path` is a local transformers model folder (it has config.json)."""
    return Path(path, "config.json").is_file()


@dataclasses.dataclass(frozen=True)
class Pretrained:
    """A loaded model, where its tokenizer is (None: unknown), the run that trained it
    (None: a transformers folder, or a checkpoint that does not record one) and the config that
    run recorded (empty for a transformers folder)."""

    model: torch.nn.Module
    tokenizer: str | None
    run_name: str | None
    recorded: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @functools.cached_property
    def chat_template(self) -> str | None:
        """The chat template of the format the run finetuned in (None: not known, or the
        tokenizer's own); read when asked, since it reads the run's data's meta.json."""
        return trained_chat_template(self.recorded.get("data"))


def load_pretrained(path: str) -> tuple[torch.nn.Module, str | None]:
    """The model at `path` (eval mode, on CPU) and its tokenizer's location (None: unknown)."""
    loaded = read_pretrained(path)
    return loaded.model, loaded.tokenizer


def read_pretrained(path: str) -> Pretrained:
    """The model at `path` (eval mode, on CPU), its tokenizer's location and its run's name."""
    if is_hf_folder(path):
        has_tokenizer = any(
            Path(path, f).is_file() for f in (TOKENIZER_FILE, "tokenizer_config.json")
        )
        model = family_of_hf(path).from_hf(path)
        return Pretrained(model, str(path) if has_tokenizer else None, None)
    located = locate(path)
    saved = located.read_model()
    where = f"{located.format.name} checkpoint {located.location!r}"
    model = model_from_weights(saved.config, saved.weights, where)
    return Pretrained(model.eval(), saved.tokenizer, saved.run_name, saved.recorded)


def model_from_weights(
    config: Any, weights: Mapping[str, torch.Tensor], where: str
) -> torch.nn.Module:
    """The model of `config`'s family holding `weights` (whole tensors), without initialising
    it first; `where` names their source in the error when they do not fit the config."""
    model = family_of(config).build(config, init_device="meta")
    try:
        model.load_state_dict(weights, strict=True, assign=True)
    except RuntimeError as err:
        raise UserError(
            f"{where}: its weights do not fit the model config it records ({err})"
        ) from None
    model.config = config  # built on meta only to skip the init; the weights are real now
    return model


def recorded_model(path: str | None) -> dict[str, Any]:
    """The model config the checkpoint (or save folder) at `path` recorded, as conf/model writes
    one (``_target_`` and fields): `model=from_checkpoint` trains, finetunes or evaluates it
    without retyping its sizes. Reads the run state only, not the weights."""
    if not path:
        raise UserError(
            "model=from_checkpoint takes the model config of load_path's checkpoint, and "
            "load_path is not set; set load_path=CKPT or choose a model=<size>"
        )
    return locate(path).model_fields()


def save_weights(
    model: torch.nn.Module,
    folder: str,
    tokenizer_file: str | Path | None = None,
    run_name: str | None = None,
) -> str:
    """Write `model` as a weights-only checkpoint in save folder `folder`; return its URL.

    It is checkpoint ep0-ba0 with `latest` pointing at it, so `load_path=<folder>` finds it.
    Besides the weights it holds the model config (so `load_pretrained` rebuilds the model) and
    a copy of `tokenizer_file` (and `run_name`, the model's name when served); it has no
    optimizer, schedule or data state.
    """
    weights = model_weights(model.state_dict())
    refuse_non_finite(
        f"a weights checkpoint in {folder}",
        weights,
        cause="in the model given",
        fix="check the model it was built or imported from",
    )
    config = family_of(model).recorded_config(model.config)
    recorded: dict[str, Any] = {"model": config}
    if run_name is not None:
        recorded["run_name"] = run_name
    state = {"format_version": FORMAT_VERSION, "config": recorded}
    files = {
        MODEL_FILE: write_tensors(weights),
        STATE_FILE: write_object(state),
    }
    if tokenizer_file is not None:
        source = str(tokenizer_file)
        files[TOKENIZER_FILE] = lambda target: shutil.copyfile(source, target)
    return write_checkpoint(folder, checkpoint_name(0, 0), files)

"""Composer's checkpoints (what llm-foundry's train.py saves), read as ours.

Two layouts, as Composer 0.32 writes them (composer/utils/checkpoint.py):
- monolithic: one ``torch.save`` file, ``ep<E>-ba<B>-rank0.pt``, holding
  ``{'state': State.state_dict(), 'rng': [per-rank RNG states]}``; read with the restricted
  unpickler (restricted_pickle.py), since it is a pickle with a few classes besides tensors;
- sharded (FSDP's ``state_dict_type: sharded``): a torch.distributed.checkpoint folder
  (``.metadata`` + ``__<rank>_0.distcp``) of the same dict, flattened to keys like
  ``state.model.model.transformer.wte.weight``; read whole in this process (dcp_reader.py, its
  non-tensor values through the restricted unpickler).

``state`` holds ``model`` (the HF wrapper's state dict: llm-foundry's MPT names under a
``model.`` prefix, equal to ours without it), ``optimizers`` ({class name: torch's optimizer
state dict keyed by those names}), ``timestamp``, ``dataset_state``, ``integrations`` (the
model's llm-foundry config and its tokenizer's files) and the state of schedulers, algorithms
and callbacks. `read_model` gives what generate/eval/serve/export/import need: the weights, our
model config for llm-foundry's (`config_from_foundry`) and the tokenizer. `read_run` turns
the rest into our run state (state_dict.py's layout), so a run llm-foundry started continues
here: weights, DecoupledAdamW's moments (the same update as our DecoupledAdamW), the position
(epoch, batch, sample, token; the schedule is a function of it) and each rank's RNG states.
What has no counterpart is named in one warning line, never silently dropped.
"""

from __future__ import annotations

import atexit
import datetime
import json
import logging
import shutil
import tempfile
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from llmfoundry.checkpoint import restricted_pickle
from llmfoundry.checkpoint.keys import FORMAT_VERSION, WEIGHTS_ONLY
from llmfoundry.checkpoint.loaded import Checkpoint
from llmfoundry.checkpoint.manifest import CheckpointError
from llmfoundry.models.families import config_from_foundry, config_from_record
from llmfoundry.utils import storage
from llmfoundry.utils.errors import UserError

log = logging.getLogger(__name__)

# The HF wrapper (ComposerMPTCausalLM) keeps the model under this attribute.
WRAPPER_PREFIX = "model."
# Composer's optimizers whose state is ours: DecoupledAdamW's step/exp_avg/exp_avg_sq update as
# our DecoupledAdamW's do (decay scaled by lr / initial_lr, torch's Adam step).
OPTIMIZERS = {"DecoupledAdamW": "llmfoundry.optim.DecoupledAdamW"}
TOKENIZER_SUFFIXES = (".json", ".txt")


@dataclass(frozen=True)
class ComposerState:
    """A Composer checkpoint read back: its ``state`` dict and its per-rank RNG states."""

    path: str
    state: dict[str, Any]
    rng: list[Any] | None


def is_monolithic(path: str) -> bool:
    """Whether `path` is a local file written by ``torch.save`` (a zip): our checkpoints are
    folders, so a file given as a checkpoint can only be Composer's."""
    return storage.is_local(path) and zipfile.is_zipfile(storage.local_path(path))


def read(path: str) -> ComposerState:
    """The Composer checkpoint at `path` (monolithic or sharded), read without running code."""
    from llmfoundry.checkpoint import composer_sharded

    if is_monolithic(path):
        saved = restricted_pickle.load(Path(storage.local_path(path)))
    else:
        saved = composer_sharded.read(path)
    if not isinstance(saved, Mapping) or not isinstance(saved.get("state"), Mapping):
        raise CheckpointError(
            f"{path} is a torch file but not a Composer checkpoint (no 'state' dict); give a "
            "Composer checkpoint (ep<E>-ba<B>-rank0.pt) or a llmfoundry checkpoint folder"
        )
    return ComposerState(path, dict(saved["state"]), saved.get("rng"))


def model_fields(saved: ComposerState) -> dict[str, Any]:
    """Our model config (recorded form: `_target_` and fields) for the llm-foundry MPT config the
    checkpoint carries."""
    hf = (saved.state.get("integrations") or {}).get("huggingface") or {}
    config = (hf.get("model") or {}).get("config") or {}
    content = config.get("content")
    if not isinstance(content, Mapping):
        raise CheckpointError(
            f"Composer checkpoint {saved.path} carries no model config (state.integrations."
            "huggingface.model.config): it was not saved by llm-foundry's HF-wrapped models"
        )
    if content.get("model_type") != "mpt":
        raise UserError(
            f"Composer checkpoint {saved.path} holds a {config.get('class')} (model_type "
            f"{content.get('model_type')!r}); llmfoundry reads llm-foundry's MPT checkpoints "
            "(model_type 'mpt'); export it with llm-foundry's convert_composer_to_hf.py instead"
        )
    return config_from_foundry(content, where=f"{saved.path}: model", weights_loaded=True)


def model_config(saved: ComposerState) -> Any:
    """`model_fields` as our config object, for CPU."""
    return config_from_record(model_fields(saved), init_device="cpu")


def weights(saved: ComposerState) -> dict[str, torch.Tensor]:
    """The model's weights by our names (llm-foundry's MPT names without the wrapper's prefix)."""
    model = saved.state.get("model")
    if not isinstance(model, Mapping) or not model:
        raise CheckpointError(f"Composer checkpoint {saved.path} holds no model weights")
    return {_our_name(name, saved.path): tensor for name, tensor in model.items()}


def _our_name(name: str, where: str) -> str:
    if not name.startswith(WRAPPER_PREFIX):
        raise CheckpointError(
            f"Composer checkpoint {where}: weight {name!r} is not under the HF wrapper's "
            f"{WRAPPER_PREFIX!r}: not an llm-foundry model"
        )
    return name.removeprefix(WRAPPER_PREFIX)


def tokenizer_folder(saved: ComposerState) -> str | None:
    """A local folder with the tokenizer files the checkpoint carries (None: it carries none, or
    no tokenizer.json: a slow tokenizer), removed when the process exits."""
    files = ((saved.state.get("integrations") or {}).get("huggingface") or {}).get("tokenizer")
    if not isinstance(files, Mapping) or "tokenizer.json" not in files:
        return None
    folder = Path(tempfile.mkdtemp(prefix="llmfoundry-composer-tokenizer-"))
    atexit.register(shutil.rmtree, folder, True)
    for name, entry in files.items():
        # Names come from the file: only plain names of text files land in the folder.
        if not _plain_name(name) or not name.endswith(TOKENIZER_SUFFIXES):
            continue
        content = entry.get("content") if isinstance(entry, Mapping) else None
        if name.endswith(".json") and isinstance(content, Mapping):
            (folder / name).write_text(json.dumps(content), encoding="utf-8")
        elif name.endswith(".txt") and isinstance(content, list):
            (folder / name).write_text("\n".join(map(str, content)), encoding="utf-8")
    return str(folder)


def _plain_name(name: Any) -> bool:
    return isinstance(name, str) and name not in ("", ".", "..") and not set("/\\\0") & set(name)


def run_name(saved: ComposerState) -> str | None:
    name = saved.state.get("run_name")
    return name if isinstance(name, str) else None


def read_run(path: str, rank: int) -> Checkpoint:
    """The Composer checkpoint at `path` as our run state for `rank` (state_dict.py's layout:
    `restore` loads it), saying in one line what does not carry over."""
    saved = read(path)
    try:
        return _run_state(saved, rank)
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as err:
        raise CheckpointError(
            f"Composer checkpoint {path}: its run state is not laid out as Composer 0.32 writes "
            f"it ({type(err).__name__}: {err}); load its weights only "
            f"(load_ignore_keys=[{','.join(WEIGHTS_ONLY)}])"
        ) from None


def _run_state(saved: ComposerState, rank: int) -> Checkpoint:
    """`read_run`'s work; raises what indexing a state of another layout raises."""
    path = saved.path
    state: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "config": {"model": model_fields(saved)},
        **{key: {} for key in ("scaler", "algorithms", "callbacks", "loggers")},
    }
    # A weights-only save (Composer's save_weights_only) has neither: `restore` then asks for
    # weights-only loading, as for our weights-only checkpoints.
    if (timestamp := _timestamp(saved)) is not None:
        state["timestamp"] = timestamp
        state["data"] = {
            "epoch": timestamp["epoch"],
            "sample_in_epoch": timestamp["sample_in_epoch"],
        }
    if optimizers := saved.state.get("optimizers"):
        name = ", ".join(optimizers)
        # Any other optimizer is refused by the resume check unless 'optimizer' is ignored.
        state["config"]["optimizer"] = {"_target_": OPTIMIZERS.get(name, f"Composer's {name}")}
        if name in OPTIMIZERS:
            state["optimizer"] = _optimizer_state(saved, optimizers[name])
    return Checkpoint(
        path=path,
        model=weights(saved),
        state=state,
        rng=_rng(saved, rank),
        origin="Composer",
        not_carried=_not_carried(saved) if timestamp is not None else None,
    )


def _timestamp(saved: ComposerState) -> dict[str, float] | None:
    """Composer's Timestamp as ours (its iteration counters are always 0 in llm-foundry)."""
    raw = (saved.state.get("timestamp") or {}).get("Timestamp")
    if not isinstance(raw, Mapping):
        return None
    wall = raw.get("total_wct")
    counters = ("epoch", "batch", "sample", "token", "batch_in_epoch", "sample_in_epoch")
    return {
        **{key: int(raw[key]) for key in (*counters, "token_in_epoch")},
        "wall_clock": wall.total_seconds() if isinstance(wall, datetime.timedelta) else 0.0,
    }


def _optimizer_state(saved: ComposerState, optimizer: Mapping[str, Any]) -> dict[str, Any]:
    """The optimizer's per-parameter state keyed by our parameter names. Only that: this run's
    parameter groups and hyperparameters apply (its lr comes from the schedule at the loaded
    position)."""
    return {"state": {_our_name(fqn, saved.path): dict(v) for fqn, v in optimizer["state"].items()}}


def _rng(saved: ComposerState, rank: int) -> dict[str, Any] | None:
    """Rank `rank`'s python, numpy and torch generator states, as llmfoundry/rng.py keeps them."""
    if not isinstance(saved.rng, list) or rank >= len(saved.rng):
        return None
    theirs = saved.rng[rank]
    version, internal, gauss = theirs["python"]
    name, keys, pos, has_gauss, cached = theirs["numpy"]
    return {
        "python": [version, list(internal), gauss],
        "numpy": [name, [int(k) for k in keys], int(pos), int(has_gauss), float(cached)],
        "torch": theirs["torch"],
    }


def _not_carried(saved: ComposerState) -> str:
    """One line: what of the Composer run does not continue here, and why."""
    state = saved.state
    parts = []
    if algorithms := [name for name, _ in state.get("algorithms") or []]:
        parts.append(f"its algorithms' state ({', '.join(algorithms)}: this run's config applies)")
    if callbacks := [name for name, value in (state.get("callbacks") or {}).items() if value]:
        parts.append(f"its callbacks' state ({', '.join(callbacks)})")
    if any((state.get("scaler") or {}).values()):
        parts.append("its fp16 loss scale (it starts afresh)")
    train = (state.get("dataset_state") or {}).get("train") or {}
    parts.append(
        "its data loader's state: the data continues at the same sample of the epoch in this "
        f"run's order (Streaming's shuffle seed {train.get('shuffle_seed')} is not used)"
    )
    return f"Composer checkpoint {saved.path}: not carried over: " + "; ".join(parts)

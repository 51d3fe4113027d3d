"""A transformers model folder, for any family: writing one (the step every family's HF export
ends with), reading one (each family's import), and how closely it computes what our model does
(import and export check it).

A folder to import is untrusted input: its config's sizes are checked before anything divides by
them (`llmfoundry.models.hf_config`), and weights transformers cannot read (a pickle the
weights-only unpickler refuses, a damaged safetensors file) or that do not fit the config (a
tensor of another shape, a missing or extra one, which transformers would fill in randomly or
drop with a warning) are a one-line :class:`UserError` naming the file or tensor and the fix.
"""

from __future__ import annotations

import contextlib
import json
import pickle
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from tokenizers import Tokenizer
from torch import nn
from transformers.utils import logging as hf_logging

from llmfoundry.models.hf_config import CONFIG_FILE, check_sizes, read_config_json
from llmfoundry.models.hf_lib import transformers
from llmfoundry.tokenizers.tokenizer import PreparedTokenizer, prepare_tokenizer
from llmfoundry.utils.errors import UserError

__all__ = [
    "load_hf_weights",
    "load_state",
    "logits_relative_error",
    "read_hf_config",
    "read_hf_weights",
    "save_hf_folder",
]

_REFETCH = "export or download the folder again"
# What transformers raises for a config or weights file it cannot read (not a bug of ours).
_UNREADABLE = (OSError, ValueError, TypeError, KeyError, RuntimeError, EOFError)
_UNREADABLE_WEIGHTS = (*_UNREADABLE, pickle.UnpicklingError, SafetensorError)
# The weights files of a transformers folder, by preference: one file, or shards an index names.
WEIGHTS_FILES = ("model.safetensors", "pytorch_model.bin")
INDEX_SUFFIX = ".index.json"
_PICKLE_REFUSED = (
    "its pickle holds objects other than tensors, refused since unpickling them could run "
    "code; use a safetensors export of the model (model.safetensors)"
)


def save_hf_folder(
    hf_model: transformers.PreTrainedModel,
    out_dir: str | Path,
    tokenizer: Tokenizer | transformers.PreTrainedTokenizerBase | None = None,
    eos_token: str | None = None,
) -> Path:
    """Save `hf_model` (safetensors) and `tokenizer` to `out_dir`; the tokenizer's EOS (a raw
    `tokenizers.Tokenizer` gets `eos_token`) becomes the model's and its generation config's,
    so transformers' `generate` stops where ours does."""
    if isinstance(tokenizer, Tokenizer):
        tokenizer = transformers.PreTrainedTokenizerFast(
            tokenizer_object=tokenizer, eos_token=eos_token
        )
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        hf_model.config.eos_token_id = tokenizer.eos_token_id
        hf_model.generation_config.eos_token_id = tokenizer.eos_token_id
    out_dir = Path(out_dir)
    hf_model.save_pretrained(out_dir, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
    return out_dir


def hf_tokenizer(
    path: str, eos_token: str | None = None, chat_template: str | None = None
) -> transformers.PreTrainedTokenizerFast:
    """The tokenizer at `path` (a tokenizer.json or transformers folder) as a transformers folder
    holds it, with `chat_template` (None: none of ours); other kinds are refused, naming the fix."""
    tokenizer = prepare_tokenizer(path, eos_token=eos_token)
    if not isinstance(tokenizer, PreparedTokenizer):
        raise UserError(
            f"a transformers folder needs a tokenizer.json tokenizer, and {path} is a "
            f"{type(tokenizer).__name__}; convert it to a transformers tokenizer folder and pass "
            "that instead"
        )
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer.tokenizer,
        eos_token=tokenizer.eos_token,
        chat_template=chat_template,
    )


def logits_relative_error(
    model: nn.Module, hf_dir: str | Path, reference: nn.Module | None = None
) -> float:
    """How exactly the transformers folder `hf_dir` computes what `model` does, in float32:
    max |ours - theirs| / max |theirs| over the logits of two rows of seeded random tokens.
    Theirs: transformers' model of the folder, or `reference` (a folder transformers could run
    only as its own remote code: the folder as our adapter reads it)."""
    if reference is None:
        reference = transformers.AutoModelForCausalLM.from_pretrained(
            hf_dir, dtype=torch.float32, local_files_only=True
        ).eval()
    seq_len = min(64, model.config.max_seq_len)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (2, seq_len), generator=generator)
    with torch.no_grad():
        ours, theirs = model(ids), reference(ids)
    theirs = getattr(theirs, "logits", theirs)
    return float((ours - theirs).abs().max() / theirs.abs().max().clamp(min=1e-30))


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """No progress bar or load report from transformers: `load_hf_weights` reports problems."""
    verbosity, bar = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bar:
            hf_logging.enable_progress_bar()


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def read_hf_config(
    hf_dir: str | Path, sizes: Iterable[str], optional_sizes: Iterable[str] = ()
) -> transformers.PretrainedConfig:
    """The transformers config of folder `hf_dir`, after checking its config.json: bounded,
    JSON, and each of `sizes` (and of `optional_sizes` if set) a positive integer."""
    check_sizes(hf_dir, read_config_json(hf_dir), tuple(sizes), tuple(optional_sizes))
    try:
        with _quiet_transformers():
            return transformers.AutoConfig.from_pretrained(hf_dir, local_files_only=True)
    except _UNREADABLE as err:
        path = Path(hf_dir, CONFIG_FILE)
        raise UserError(
            f"{path}: transformers cannot read it ({_first_line(err)}); fix it or {_REFETCH}"
        ) from None


def load_hf_weights(
    model_class: type[transformers.PreTrainedModel],
    hf_dir: str | Path,
    config: transformers.PretrainedConfig,
) -> transformers.PreTrainedModel:
    """`model_class` with the weights of folder `hf_dir`, in float32: every tensor of the model
    read from the folder with the shape `config` gives it, none missing and none left over."""
    files = sorted(p.name for p in Path(hf_dir).glob("*") if p.suffix in (".safetensors", ".bin"))
    where = f"{hf_dir} ({', '.join(files) or 'no weights file'})"
    try:
        with _quiet_transformers():
            model, info = model_class.from_pretrained(
                hf_dir,
                config=config,
                dtype=torch.float32,
                local_files_only=True,
                ignore_mismatched_sizes=True,  # reported below, naming the tensor
                output_loading_info=True,
            )
    except pickle.UnpicklingError:
        raise UserError(f"{where}: {_PICKLE_REFUSED}") from None
    except _UNREADABLE_WEIGHTS as err:
        raise UserError(
            f"{where}: cannot read its weights ({_first_line(err)}); {_REFETCH}"
        ) from None
    _refuse_unfit(
        where,
        info.get("mismatched_keys") or (),
        info.get("missing_keys") or (),
        info.get("unexpected_keys") or (),
    )
    if info.get("error_msgs"):
        raise UserError(f"{where}: cannot load its weights ({info['error_msgs'][0]}); {_REFETCH}")
    return model


def _weights_files(hf_dir: Path) -> list[Path]:
    """The files holding the folder's weights: model.safetensors, else pytorch_model.bin, or
    the shards their index (`<name>.index.json`) lists, each a file of the folder itself."""
    for name in WEIGHTS_FILES:
        if (hf_dir / name).is_file():
            return [hf_dir / name]
        index = hf_dir / f"{name}{INDEX_SUFFIX}"
        if not index.is_file():
            continue
        try:
            weight_map = json.loads(index.read_bytes())["weight_map"]
            shards = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise UserError(f"{index}: not a readable weights index ({err}); {_REFETCH}") from None
        for shard in shards:
            if not isinstance(shard, str) or Path(shard).name != shard or shard in ("", ".", ".."):
                raise UserError(f"{index}: shard {shard!r} is not a file name of the folder")
        return [hf_dir / shard for shard in shards]
    raise UserError(
        f"{hf_dir} has no weights ({' or '.join(WEIGHTS_FILES)}, or their {INDEX_SUFFIX}); "
        f"{_REFETCH}"
    )


def _read_weights_file(path: Path) -> dict[str, torch.Tensor]:
    """One weights file's tensors: safetensors, or a torch.save pickle read weights-only
    (memory-mapped, so a large file costs no more memory than the tensors the model keeps)."""
    try:
        if path.suffix == ".safetensors":
            return load_file(path)
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError:
        raise UserError(f"{path}: {_PICKLE_REFUSED}") from None
    except _UNREADABLE_WEIGHTS as err:
        raise UserError(
            f"{path}: cannot read its weights ({_first_line(err)}); {_REFETCH}"
        ) from None
    if not isinstance(state, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()
    ):
        raise UserError(f"{path}: not a state dict (names to tensors); {_REFETCH}")
    return state


def read_hf_weights(hf_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the transformers folder `hf_dir` by name, read without transformers
    (a folder whose model class is its own remote code): from model.safetensors or
    pytorch_model.bin (weights-only), or their shards. A name in two shards is refused."""
    state: dict[str, torch.Tensor] = {}
    for path in _weights_files(Path(hf_dir)):
        if not path.is_file():
            raise UserError(f"{path}: a shard its index lists is missing; {_REFETCH}")
        tensors = _read_weights_file(path)
        if twice := sorted(state.keys() & tensors.keys()):
            raise UserError(f"{path}: tensor {twice[0]} is in another shard too; {_REFETCH}")
        state.update(tensors)
    return state


def load_state(model: nn.Module, state: dict[str, torch.Tensor], where: str) -> None:
    """Put `state` (a folder's tensors) into `model` (built on meta), in place: every tensor
    of the model there with its shape, none missing and none left over."""
    expected = model.state_dict()
    mismatched = [
        (key, state[key].shape, expected[key].shape)
        for key in expected.keys() & state.keys()
        if state[key].shape != expected[key].shape
    ]
    _refuse_unfit(where, mismatched, expected.keys() - state.keys(), state.keys() - expected.keys())
    model.load_state_dict(state, strict=True, assign=True)


def _refuse_unfit(
    where: str,
    mismatched: Iterable[tuple[str, Any, Any]],
    missing: Iterable[str],
    unexpected: Iterable[str],
) -> None:
    """The one-line refusal of weights that do not fit the folder's config: the first tensor of
    another shape (name, found, expected), else the tensors missing, else those left over."""
    for key, found, expected in sorted(mismatched):
        raise UserError(
            f"{where}: tensor {key} has shape {list(found)}, but {CONFIG_FILE} makes it "
            f"{list(expected)}; {_REFETCH} (weights and {CONFIG_FILE} from the same export)"
        )
    for keys, what in (
        (missing, "lack"),
        (unexpected, "hold tensors the model has no place for:"),
    ):
        if names := sorted(keys):
            raise UserError(f"{where}: the weights {what} {', '.join(names[:5])}; {_REFETCH}")

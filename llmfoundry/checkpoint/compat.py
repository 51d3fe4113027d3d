"""Resuming with a changed recipe: what cannot work is refused, what changes the run is said.

A checkpoint keeps the config of the run that saved it (``config`` in state.pt). On load it is
compared with the config of the run that loads it:

- refused, with each key and both values: a different model family (``model._target_``) or
  architecture (the family spec's `architecture` keys: the weights would not fit, or would fit
  and mean something else) and a different optimizer class
  (AdamW moments loaded into Lion). `load_ignore_keys` opts out: with ``model`` (or
  ``optimizer``) ignored, that part starts afresh and may differ;
- warned about, in one line: keys that are legal to change but make the run differ from an
  uninterrupted one (`RUN_CHANGING`: global batch size, lr and the rest of the optimizer and
  schedule, data, precision, ...). A changed optimizer setting takes effect: the loaded
  optimizer state keeps the new config's hyperparameters (`keep_hyperparameters`);
- not mentioned: the recipe of a new run from a checkpoint's weights (``timestamp`` ignored,
  e.g. finetuning), and where the run writes and how long it runs (save_folder, loggers, callbacks,
  max_duration, eval settings, the strategy and the device batch sizes).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Collection, Iterator, Mapping
from typing import Any

import torch

from llmfoundry.checkpoint.manifest import CheckpointError

log = logging.getLogger(__name__)

# Top-level keys (and config groups) whose change makes the run differ.
RUN_CHANGING = (
    "global_train_batch_size",
    "max_seq_len",
    "seed",
    "precision",
    "model",
    "optimizer",
    "scheduler",
    "data",
    "converters",
    "algorithms",
)
_ABSENT = "<absent>"
# Keys added to conf/ after checkpoints were written without them, with the value that keeps
# the behaviour of before: a checkpoint without one ran with that value, not another recipe.
ADDED_KEYS = {"scheduler.composer_lag": False}


def check_resume(
    saved: Mapping[str, Any], new: Mapping[str, Any], ignore: Collection[str], where: str
) -> None:
    """Refuse or warn about the differences between a checkpoint's config and this run's.

    Either config may be empty (a run built without one): nothing is compared then.
    """
    if not saved or not new:
        return
    architecture = {"_target_", *_architecture(saved), *_architecture(new)}
    before, after = _with_added_keys(_flatten(_resolved(saved))), _flatten(_resolved(new))
    changed = sorted(
        key
        for key in before.keys() | after.keys()
        if before.get(key, _ABSENT) != after.get(key, _ABSENT)
    )

    def describe(key: str) -> str:
        return f"{key}: {_show(before.get(key, _ABSENT))} -> {_show(after.get(key, _ABSENT))}"

    def cannot_change(key: str) -> bool:
        if key.startswith("model.") and key.split(".")[1] in architecture:
            return "model" not in ignore
        return key == "optimizer._target_" and "optimizer" not in ignore

    refused = [key for key in changed if cannot_change(key)]
    if refused:
        parts = " and ".join(sorted({key.split(".")[0] for key in refused}))
        raise CheckpointError(
            f"checkpoint {where} cannot continue with this config (checkpoint -> now: "
            f"{'; '.join(describe(k) for k in refused)}); set these back, or add {parts} to "
            "load_ignore_keys to start afresh what they configure"
        )
    warned = [k for k in changed if k.split(".")[0] in RUN_CHANGING]
    if warned and "timestamp" not in ignore:  # with the timestamp ignored it is a new run
        log.warning(
            "resuming %s with a changed recipe (checkpoint -> now): %s; the new values apply "
            "from here, so the run differs from an uninterrupted one",
            where,
            "; ".join(describe(k) for k in warned),
        )


@contextlib.contextmanager
def keep_hyperparameters(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Load optimizer state inside this block and keep this run's hyperparameters (lr, betas,
    weight decay, ...): ``load_state_dict`` would bring back the saved ones, silently undoing
    a changed optimizer config.

    The current ``lr`` is the schedule's multiplier times ``initial_lr``: the loaded multiplier
    is kept and applied to this run's ``initial_lr``.
    """
    fresh = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    yield
    for group, values in zip(optimizer.param_groups, fresh, strict=True):
        lr, initial = group["lr"], group.get("initial_lr")
        group.update(values)
        if initial and group.get("initial_lr", initial) == initial:
            group["lr"] = lr  # the same recipe: exactly the saved value
        elif initial:
            group["lr"] = lr * group["initial_lr"] / initial


def _family(config: Mapping[str, Any]):
    """The model family of a recorded config (None: no model, or an unknown _target_, which
    the model build reports)."""
    from llmfoundry.models.families import family_of_target

    model = config.get("model")
    if not isinstance(model, Mapping):
        return None
    try:
        return family_of_target(model.get("_target_"))
    except ValueError:
        return None


def _architecture(config: Mapping[str, Any]) -> tuple[str, ...]:
    """The keys a resume must match: the family's; an unknown family's model is held to the
    default family's (as before there were families)."""
    from llmfoundry.models.families import DEFAULT

    return (_family(config) or DEFAULT).architecture


def _resolved(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """`config` with its model's architecture fields as the model resolves them (MPT's null
    kv_n_heads is n_heads, Llama's null ffn_hidden_size is Meta's rule...): a checkpoint written
    by scripts/import_hf.py records them resolved, a training config usually leaves them null,
    and both mean the same model."""
    family = _family(config)
    if family is None or "_target_" not in config["model"]:
        return config
    model = config["model"]
    try:
        resolved = family.recorded_config(family.config_from({**model, "init_device": "meta"}))
    except (TypeError, ValueError):
        return config  # an invalid model config is reported by the model itself
    arch = {k: resolved[k] for k in family.architecture if k in resolved}
    return {**config, "model": {**model, **arch}}


def _with_added_keys(flat: dict[str, Any]) -> dict[str, Any]:
    """`flat` with each of `ADDED_KEYS` it lacks where it records the key's group."""
    for key, value in ADDED_KEYS.items():
        group = key.rsplit(".", 1)[0] + "."
        if key not in flat and any(name.startswith(group) for name in flat):
            flat[key] = value
    return flat


def _flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(_flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def _show(value: Any) -> str:
    text = value if value is _ABSENT else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."

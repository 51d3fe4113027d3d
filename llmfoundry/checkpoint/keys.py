"""The keys of a checkpoint that `load_ignore_keys` may name, and its check (torch-free: the
config check validates `load_ignore_keys` before torch is imported; state_dict.py saves them)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable

from llmfoundry.utils.errors import UserError

log = logging.getLogger(__name__)

FORMAT_VERSION = 2  # 2: optimizer state keyed by parameter name; sharded checkpoints
LOADABLE_KEYS = (
    "model",
    "optimizer",
    "scaler",
    "timestamp",
    "algorithms",
    "callbacks",
    "loggers",
    "data",
    "rng",
)
WEIGHTS_ONLY = tuple(k for k in LOADABLE_KEYS if k != "model")


# No longer a checkpoint key (it was always empty); in `load_ignore_keys` it is dropped.
_REMOVED_KEYS = ("scheduler",)


def check_ignore_keys(keys: Iterable[str]) -> tuple[str, ...]:
    """Validate `load_ignore_keys`; the data position is meaningless without its timestamp."""
    keys = tuple(keys)
    if removed := [k for k in keys if k in _REMOVED_KEYS]:
        _warn_removed(tuple(removed))
        keys = tuple(k for k in keys if k not in _REMOVED_KEYS)
    unknown = [k for k in keys if k not in LOADABLE_KEYS]
    if unknown:
        raise UserError(
            f"load_ignore_keys: unknown key(s) {unknown}; allowed: {', '.join(LOADABLE_KEYS)}"
        )
    if "timestamp" in keys and "data" not in keys:
        raise UserError(
            "load_ignore_keys: has 'timestamp' but not 'data', yet the data position only makes "
            "sense with the timestamp it was saved at; add 'data' (the data then starts from the "
            "beginning of epoch 0)"
        )
    return keys


@functools.cache  # once per process: configs are checked before the run and again on load
def _warn_removed(keys: tuple[str, ...]) -> None:
    log.warning(
        "load_ignore_keys: %s is no longer a part of checkpoints (learning-rate schedules are "
        "functions of the timestamp; the slot was always empty) and is ignored; remove it",
        ", ".join(keys),
    )

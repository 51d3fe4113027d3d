"""Skip a data_prep step whose output was already made from the same inputs and settings.

Each step records a fingerprint of everything its output depends on (input files' sizes and
times, tokenizer hash, options) in the output's metadata. A rerun computes the fingerprint
again: the same one means the output is reused as is; a different one is an error unless
``--overwrite`` is given, so data made from other inputs is never silently mixed or replaced.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from llmfoundry.data.meta import read_meta, remove_meta
from llmfoundry.utils.errors import OutputExists, UserError

__all__ = ["is_reusable", "previous_output", "settings_fingerprint"]


def settings_fingerprint(settings: Mapping[str, Any]) -> str:
    """A stable hash of JSON-able settings (key order does not matter)."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()


def is_reusable(previous: Mapping[str, Any] | None, key: str, overwrite: bool, out: str) -> bool:
    """Whether ``previous`` (an output's metadata, None if absent) was made with fingerprint ``key``.

    Raises FileExistsError naming ``out`` when the output was made from other inputs or settings
    and ``overwrite`` is false; with ``overwrite`` the output is never reused.
    """
    if previous is None or overwrite:
        return False
    if previous.get("fingerprint") == key:
        return True
    raise OutputExists(
        f"{out} was made from other inputs or settings; pass --overwrite to replace it, or "
        "choose another output"
    )


def previous_output(out: str, key: str, overwrite: bool) -> dict[str, Any] | None:
    """``out``'s meta.json if it was made with fingerprint ``key`` (reuse the output), else None.

    Before a rewrite the old meta.json goes first: it must not describe half-rewritten splits.
    Raises as `is_reusable` does, and `UserError` for a malformed meta.json unless
    ``overwrite`` (which replaces it).
    """
    try:
        previous = read_meta(out)
    except UserError:
        if not overwrite:
            raise
        remove_meta(out)
        return None
    if is_reusable(previous, key, overwrite, out):
        return previous
    if previous is not None:
        remove_meta(out)
    return None

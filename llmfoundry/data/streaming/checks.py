"""Argument checks shared by the trainer datasets."""

from __future__ import annotations

from typing import Any

import numpy as np

from llmfoundry.utils.errors import UserError

__all__ = ["check_int"]


def check_int(name: str, value: Any, minimum: int, optional: bool = False) -> None:
    """Raise UserError (a ValueError) naming ``name`` unless ``value`` is an integer >= ``minimum``."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        allowed = f"an integer >= {minimum}" + (" or null" if optional else "")
        raise UserError(f"{name} must be {allowed}, got {value!r}")

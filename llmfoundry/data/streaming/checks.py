"""Argument checks shared by the streaming dataset and its config."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["check_int"]


def check_int(name: str, value: Any, minimum: int, optional: bool = False) -> None:
    """Raise ValueError naming ``name`` unless ``value`` is an integer >= ``minimum``."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        allowed = f"an integer >= {minimum}" + (" or null" if optional else "")
        raise ValueError(f"{name} must be {allowed}, got {value!r}")

"""What every part of the llm-foundry translation shares: refusals, key checks, Composer time."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from llmfoundry.utils.errors import UserError

# Composer's time units (composer/core/time.py TimeUnit) and ours (llmfoundry/core/time.py).
_COMPOSER_TIME = re.compile(r"^(.+?)(iter|ep|ba|sp|tok|dur|sec)$", re.IGNORECASE)
_TIMEDELTA = re.compile(r"^(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?$")


def refuse(key: str, message: str) -> UserError:
    """The one-line refusal of llm-foundry key `key`: what it is and what to use instead."""
    return UserError(f"llm-foundry key {key}: {message}")


def check_known(where: str, node: Mapping[str, Any], known: Iterable[str]) -> None:
    """Refuse the first key of `node` not in `known` (a key we cannot honour is never dropped)."""
    allowed = sorted(known)
    for key in node:
        if key not in allowed:
            raise refuse(
                f"{where}.{key}" if where else str(key),
                f"not supported here (supported keys: {', '.join(allowed)})",
            )


def section(cfg: Mapping[str, Any], key: str) -> dict[str, Any]:
    """The mapping under `key` ({} when absent or null), refused when it is not a mapping."""
    value = cfg.get(key)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise refuse(key, f"must be a mapping, got {value!r}")
    return dict(value)


def only(key: str, value: Any, accepted: Any, instead: str) -> None:
    """Refuse `key` unless its `value` is the `accepted` one (the only one we behave as)."""
    if value != accepted:
        raise refuse(key, f"{value!r} is not supported here (only {accepted!r}); {instead}")


def composer_time(key: str, value: Any, int_unit: str = "ep") -> str:
    """Composer's time `value` (``"10ba"``, ``"3e4tok"``, ``"0.5dur"``, ``"1h30m"``, or an int
    counted in `int_unit`, epochs for durations and intervals) as our Time string, same amount."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise refuse(key, f"expected a Composer time (e.g. 10ba, 1ep, 0.5dur), got {value!r}")
    if isinstance(value, (int, float)):
        return _count(key, float(value), int_unit)
    text = value.strip()
    if clock := _TIMEDELTA.match(text):
        if any(clock.groups()):
            hours, minutes, seconds = (int(part or 0) for part in clock.groups())
            return f"{hours * 3600 + minutes * 60 + seconds}sec"
    match = _COMPOSER_TIME.match(text)
    if not match:
        raise refuse(key, f"{value!r} is not a Composer time (e.g. 10ba, 1ep, 100tok, 0.5dur)")
    unit = match.group(2).lower()
    if unit == "iter":
        raise refuse(key, f"{value!r}: iterations are epochs here; give it in ep (or ba)")
    try:
        amount = float(match.group(1))
    except ValueError:
        raise refuse(key, f"{value!r}: {match.group(1)!r} is not a number") from None
    if unit == "dur":
        return f"{amount:g}dur"
    return _count(key, amount, unit)


def _count(key: str, amount: float, unit: str) -> str:
    if amount != int(amount) or amount < 0:
        raise refuse(key, f"{amount:g}{unit}: counted in whole numbers; use dur for a fraction")
    return f"{int(amount)}{unit}"

"""Time in the units training is measured in: epochs, batches, samples, tokens, a fraction of the
whole run, or wall-clock seconds.

Every duration in the config (`max_duration`, `eval_interval`, `save_interval`, warmups) is a
string such as ``"100ba"``, ``"1ep"``, ``"2_000_000tok"``, ``"500sp"``, ``"0.5dur"``, ``"2h"`` or
``"1h30m"``, so a recipe can be written in the unit that matters to it and still be compared with
the loop's counters.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from enum import Enum
from typing import Annotated

from llmfoundry.utils.errors import UserError


class TimeUnit(str, Enum):
    EPOCH = "ep"
    BATCH = "ba"
    SAMPLE = "sp"
    TOKEN = "tok"
    DURATION = "dur"
    SECOND = "sec"


# Wall-clock suffixes and their length in seconds.
_WALL_CLOCK = {"s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600, "d": 86400}
# Digits may be grouped with single underscores, as in Python: 4_000tok.
_NUMBER = r"(?:\d+(?:_\d+)*(?:\.(?:\d+(?:_\d+)*)?)?(?:e[+-]?\d+)?|\.\d+)"
_PATTERN = re.compile(rf"^\s*({_NUMBER})\s*([a-z]+)\s*$", re.IGNORECASE)
# A compound wall-clock duration such as 1h30m or 2d12h: two or more number-unit parts.
_PART = re.compile(rf"({_NUMBER})([a-z]+)", re.IGNORECASE)
_COMPOUND = re.compile(rf"^\s*(?:{_NUMBER}[a-z]+){{2,}}\s*$", re.IGNORECASE)
_UNITS_HELP = (
    "ep, ba, sp, tok, dur, or wall-clock s/m/h/d (e.g. '100ba', '4_000tok', '0.5dur', '1h30m')"
)


def _wall_clock_seconds(text: str) -> float:
    """Seconds in a compound wall-clock string, its units from largest to smallest, each once."""
    total, previous = 0.0, float("inf")
    for number, suffix in _PART.findall(text):
        length = _WALL_CLOCK.get(suffix.lower())
        if length is None:
            raise UserError(
                f"{text!r}: only wall-clock units (s, m, h, d) combine, e.g. '1h30m'; "
                f"{suffix!r} does not"
            )
        if length >= previous:
            raise UserError(f"{text!r}: write the largest unit first, each once, e.g. '1h30m'")
        total, previous = total + float(number) * length, length
    return total


@dataclass(frozen=True)
class Time:
    """A non-negative amount of time in one unit. Counting units hold integers."""

    value: float
    unit: TimeUnit

    def __post_init__(self) -> None:
        if self.value < 0:
            raise UserError(f"time must not be negative, got {self.value}{self.unit.value}")
        if self.unit in (TimeUnit.EPOCH, TimeUnit.BATCH, TimeUnit.SAMPLE, TimeUnit.TOKEN):
            if self.value != int(self.value):
                raise UserError(
                    f"{self.value}{self.unit.value}: {self.unit.name.lower()}s are counted in "
                    "whole numbers; use 'dur' for a fraction of the run"
                )
            object.__setattr__(self, "value", int(self.value))

    @classmethod
    def parse(cls, text: str | Time) -> Time:
        """Parse ``"100ba"``-style strings; a Time passes through unchanged."""
        if isinstance(text, Time):
            return text
        if not isinstance(text, str):
            raise UserError(f"expected a time string with a unit ({_UNITS_HELP}), got {text!r}")
        match = _PATTERN.match(text)
        if not match and _COMPOUND.match(text):
            return cls(_wall_clock_seconds(text), TimeUnit.SECOND)
        if not match:
            raise UserError(f"cannot parse time {text!r}: use a number and a unit ({_UNITS_HELP})")
        number, suffix = float(match.group(1)), match.group(2).lower()
        if suffix in _WALL_CLOCK:
            return cls(number * _WALL_CLOCK[suffix], TimeUnit.SECOND)
        try:
            unit = TimeUnit(suffix)
        except ValueError:
            raise UserError(
                f"unknown time unit {suffix!r} in {text!r}: use {_UNITS_HELP}"
            ) from None
        return cls(number, unit)

    def __str__(self) -> str:
        return f"{self.value:g}{self.unit.value}"


# A config value holding a Time string: the config check parses it before the run starts
# (llmfoundry/config/schema.py), so `t_warmup=abc` fails in the first second, not at step 1.
TimeString = Annotated[str, Time.parse]


@dataclass
class Timestamp:
    """The loop's counters, in total and within the current epoch, plus elapsed wall-clock time."""

    epoch: int = 0
    batch: int = 0
    sample: int = 0
    token: int = 0
    batch_in_epoch: int = 0
    sample_in_epoch: int = 0
    token_in_epoch: int = 0
    wall_clock: float = 0.0

    def get(self, unit: TimeUnit) -> float:
        """The total count in a counting unit (or seconds for wall-clock)."""
        counters = {
            TimeUnit.EPOCH: self.epoch,
            TimeUnit.BATCH: self.batch,
            TimeUnit.SAMPLE: self.sample,
            TimeUnit.TOKEN: self.token,
            TimeUnit.SECOND: self.wall_clock,
        }
        if unit not in counters:
            raise ValueError(f"a timestamp has no absolute count in {unit.value!r}")
        return counters[unit]

    def after_batch(self, samples: int, tokens: int, seconds: float) -> None:
        """Advance past one optimizer step that consumed `samples` samples and `tokens` tokens."""
        self.batch += 1
        self.sample += samples
        self.token += tokens
        self.batch_in_epoch += 1
        self.sample_in_epoch += samples
        self.token_in_epoch += tokens
        self.wall_clock += seconds

    def after_epoch(self) -> None:
        self.epoch += 1
        self.batch_in_epoch = self.sample_in_epoch = self.token_in_epoch = 0

    def state_dict(self) -> dict[str, float]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, float]) -> None:
        for key, value in state.items():
            setattr(self, key, value)

"""What a chat template builds, in units of a rendering's budget, known before it is built.

`chat_template.py` routes everything a template builds (operators, `~`, slices, literals,
filters, method calls, output) through `charged`: the estimate of what the operation builds is
charged to the rendering's `SizeBudget` before it runs, and settled to the real size after. A
unit is a character of a string, an item of a list or dict, or a byte of an integer. The
estimates here are from above, so a refusal comes before the allocation: `"x" * 10**9` costs
nothing, and `[s] * 1000` printed is counted as the thousand copies of `s` it prints.
"""

from __future__ import annotations

import contextvars
import re
import string
from collections.abc import Callable, ItemsView, KeysView, Mapping, Sequence, ValuesView
from itertools import chain
from typing import Any

from jinja2.utils import Namespace

__all__ = [
    "BUDGET",
    "FILTER_SIZES",
    "LISTED",
    "MAX_INT_BITS",
    "PRINTING_FILTERS",
    "IntegerTooLarge",
    "SizeBudget",
    "SizeSpent",
    "as_int",
    "binop_size",
    "current_budget",
    "charged",
    "method_size",
    "shape",
    "size_of",
    "str_format_size",
    "text_size",
]

MAX_INT_BITS = 1 << 16  # an integer a template computes (no prompt needs one past 64 bits)


class SizeSpent(Exception):
    """Raised before a template builds what its size budget cannot pay for (its text: where).
    Not a TypeError or ValueError, which jinja2 and filters catch to try something else."""

    def describe(self, limit: int) -> str:
        return f"more than {limit} characters (at {self})"


class IntegerTooLarge(SizeSpent):
    """Raised before a template computes an integer past `MAX_INT_BITS` (its text: which)."""

    def describe(self, limit: int) -> str:
        return str(self)


class SizeBudget:
    """What a rendering may still build, in units (chat_template.py's docstring: Memory)."""

    def __init__(self, units: int) -> None:
        self.limit = self.left = units

    def charge(self, units: int, what: str) -> None:
        self.left -= units
        if self.left < 0:
            raise SizeSpent(what)


# The budget of the rendering running in this thread (a context variable: the server renders in
# worker threads). None outside a rendering, where nothing may be built: jinja2's compile-time
# folding then fails and leaves the expression to run, charged, at render time.
BUDGET: contextvars.ContextVar[SizeBudget | None] = contextvars.ContextVar(
    "chat_template_budget", default=None
)


def current_budget() -> SizeBudget:
    budget = BUDGET.get()
    if budget is None:
        raise SizeSpent("building outside a rendering")
    return budget


def size_of(value: Any) -> int:
    """What `value` holds, in budget units: characters, items, or bytes of an integer."""
    if isinstance(value, (str, bytes, list, tuple, dict, set, frozenset)):
        return len(value)
    if isinstance(value, int):
        return value.bit_length() // 8
    return 0


def charged(estimate: int, what: str, build: Callable[[], Any]) -> Any:
    """`build()`, paid for: `estimate` (from above) before, settled to the result's size after."""
    budget = current_budget()
    budget.charge(estimate, what)
    result = build()
    budget.charge(size_of(result) - estimate, what)
    return result


_END = object()
_WALK_OVERHEAD = 64  # what an object that is not data shows of itself (`<Macro 'm'>`)
_CONTAINERS = (dict, list, tuple, set, frozenset)
_VIEWS = (Mapping, ItemsView, KeysView, ValuesView)  # abstract: checked last, they are slower


def _scalar_size(item: Any) -> int | None:
    """Characters of `str(item)` for a string or a number (from above), else None."""
    if isinstance(item, str):
        return len(item) + 2  # quoted inside a container
    if isinstance(item, int):
        return item.bit_length() // 3 + 2
    if isinstance(item, float) or item is None:
        return 24
    return None


def _children(item: Any) -> tuple[Any, int] | None:
    """(the items of a container, a mapping's keys and values; how many), or None when `item`
    is not one."""
    if isinstance(item, Namespace):
        item = object.__getattribute__(item, "_Namespace__attrs")
    if isinstance(item, (dict, Mapping)):
        return chain.from_iterable(item.items()), len(item)
    if isinstance(item, ItemsView):
        return chain.from_iterable(item), len(item)
    if isinstance(item, (*_CONTAINERS, *_VIEWS)):
        return iter(item), len(item)
    return None


def shape(value: Any, limit: int) -> tuple[int, int]:
    """(characters of `str(value)`, nesting depth), the size counted past `limit` only until
    it is known to be past it. Containers are walked: a list holding one long string a thousand
    times prints it a thousand times. A container inside itself counts once."""
    size, depth = 0, 0
    pending: list[tuple[Any, int]] = [(iter((value,)), 0)]
    while pending and size <= limit:
        item = next(pending[-1][0], _END)
        if item is _END:
            pending.pop()
            continue
        scalar = _scalar_size(item)
        if scalar is not None:
            size += scalar
            continue
        container = _children(item)
        if container is None:
            size += _WALK_OVERHEAD
            continue
        children, count = container
        size += 2 + 4 * count
        if any(id(item) == seen for _, seen in pending):
            continue
        pending.append((children, id(item)))
        depth = max(depth, len(pending) - 1)
    return size, depth


def text_size(value: Any) -> int:
    """Characters of `str(value)` (an estimate from above, see `shape`)."""
    if isinstance(value, str):
        return len(value)
    scalar = _scalar_size(value)
    return scalar if scalar is not None else shape(value, current_budget().left)[0]


def as_int(value: Any, default: int = 0) -> int:
    return value if isinstance(value, int) else default


_NUMBER = re.compile(r"\d+")
_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d*)(?:\.(\*|\d*))?[hlL]?[a-zA-Z%]")


def _numbers(text: str) -> int:
    """The sum of the numbers written in `text` (widths and precisions of a format)."""
    return sum(int(n) if len(n) < 19 else 1 << 62 for n in _NUMBER.findall(text))


def _format_size(fields: int, numbers: int, fmt: str, values: Sequence[Any]) -> int:
    """A format's output, from above: each field prints the largest value padded to the widths."""
    biggest = max((text_size(v) for v in values), default=0)
    return len(fmt) + fields * biggest + numbers


def _percent_size(fmt: str, args: Any) -> int:
    """`fmt % args`, from above."""
    values = list(args.values()) if isinstance(args, Mapping) else args
    values = list(values) if isinstance(values, (tuple, list)) else [values]
    specs = _PERCENT_SPEC.findall(fmt)
    numbers = _numbers(" ".join(w + " " + p for w, p in specs))
    if any("*" in (w, p) for w, p in specs):
        numbers += sum(abs(v) for v in values if isinstance(v, int))
    return _format_size(len(specs), numbers, fmt, values)


def str_format_size(fmt: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> int:
    """`fmt.format(*args, **kwargs)`, from above (a field can name one argument many times)."""
    values = [*args, *kwargs.values()]
    fields, numbers = 0, 0
    for _, field, spec, _ in string.Formatter().parse(fmt):
        if field is not None:
            fields += 1
            numbers += _numbers(spec or "")
            if "{" in (spec or ""):
                numbers += sum(abs(v) for v in values if isinstance(v, int))
    return _format_size(fields, numbers, fmt, values)


def _replace_size(text: str, old: Any, new: Any, count: Any) -> int:
    """`text.replace(old, new, count)`: every match grows by what `new` adds."""
    if not isinstance(old, str) or not isinstance(new, str):
        return len(text)
    matches = len(text) + 1 if old == "" else text.count(old)
    if isinstance(count, int) and count >= 0:
        matches = min(matches, count)
    return len(text) + matches * max(len(new) - len(old), 0)


def _arg(args: Sequence[Any], kwargs: Mapping[str, Any], i: int, name: str, default: Any) -> Any:
    return args[i] if len(args) > i else kwargs.get(name, default)


def method_size(owner: Any, name: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> int:
    """What a method of a string, bytes or integer builds, from above (0: at most its own size,
    settled after the call)."""
    n = len(owner) if isinstance(owner, (str, bytes)) else 0
    if name in ("center", "ljust", "rjust", "zfill"):
        return max(n, as_int(_arg(args, kwargs, 0, "width", 0)))
    if name == "expandtabs":
        return n * max(1, as_int(_arg(args, kwargs, 0, "tabsize", 8)))
    if name == "replace" and isinstance(owner, str) and len(args) >= 2:
        return _replace_size(owner, args[0], args[1], _arg(args, kwargs, 2, "count", -1))
    if name == "join" and args and isinstance(args[0], list):
        return text_size(args[0]) + n * len(args[0])
    if name == "translate" and isinstance(owner, str) and args and isinstance(args[0], Mapping):
        longest = max((len(v) for v in args[0].values() if isinstance(v, str)), default=1)
        return n * max(longest, 1)
    if name == "to_bytes":
        return as_int(_arg(args, kwargs, 0, "length", 1))
    return 0


def binop_size(op: str, left: Any, right: Any) -> int:
    """What `left op right` builds, from above; an integer past `MAX_INT_BITS` is refused."""
    sequences = (str, bytes, list, tuple)
    if op == "*" and isinstance(left, int) and isinstance(right, sequences):
        left, right = right, left
    if op == "*" and isinstance(left, sequences) and isinstance(right, int):
        return len(left) * max(right, 0)
    if op == "+" and isinstance(left, sequences) and isinstance(right, sequences):
        return len(left) + len(right)
    if op == "%" and isinstance(left, str):
        return _percent_size(left, right)
    if isinstance(left, int) and isinstance(right, int):
        bits = max(left.bit_length(), right.bit_length()) + 1
        if op == "*":
            bits = left.bit_length() + right.bit_length()
        elif op == "**":  # 0, 1 and -1 stay one bit whatever the power
            bits = 1 if abs(left) <= 1 else max(right, 0) * left.bit_length()
        if bits > MAX_INT_BITS:
            raise IntegerTooLarge(f"an integer of {bits} bits from '{op}' (at most {MAX_INT_BITS})")
        return bits // 8
    return 0


# Filters that print their value (`str(value)`), and by how much their text can grow.
PRINTING_FILTERS = {
    "capitalize": 3,  # 'ß' -> 'SS', 'ŉ' -> 'ʼN'
    "e": 6,
    "escape": 6,
    "forceescape": 6,
    "lower": 3,
    "safe": 1,
    "string": 1,
    "striptags": 1,
    "title": 3,
    "trim": 1,
    "upper": 3,
    "urlencode": 12,  # %XX for each byte of a 4-byte character
    "wordcount": 1,
    "xmlattr": 6,
}


def _lines(value: Any) -> int:
    return value.count("\n") + 1 if isinstance(value, str) else text_size(value) + 1


def _width(value: Any) -> int:
    return len(value) if isinstance(value, str) else as_int(value)


def _json_size(a: Mapping[str, Any]) -> int:
    size, depth = shape(a["x"], current_budget().left)
    separators = a.get("separators") or (", ", ": ")
    grow = 6 if a.get("ensure_ascii") else 1  # \uXXXX
    return size * grow * (1 + depth * _width(a.get("indent")) + sum(map(len, separators)))


# name -> what the filter builds, from above, given its arguments by name (defaults applied).
FILTER_SIZES: dict[str, Callable[[Mapping[str, Any]], int]] = {
    "batch": lambda a: as_int(a["linecount"]) if a["fill_with"] is not None else 0,
    "center": lambda a: max(text_size(a["value"]), as_int(a["width"])),
    "format": lambda a: (
        _percent_size(a["value"], a["kwargs"] or a["args"])
        if isinstance(a["value"], str)
        else text_size(a["value"])
    ),
    "indent": lambda a: text_size(a["s"]) + _lines(a["s"]) * _width(a["width"]),
    "join": lambda a: text_size(a["value"]) + len(str(a["d"])) * len(a["value"]),
    "pprint": lambda a: text_size(a["value"]) * (1 + shape(a["value"], current_budget().left)[1]),
    "replace": lambda a: (
        _replace_size(a["s"], a["old"], a["new"], a["count"])
        if isinstance(a["s"], str)
        else text_size(a["s"]) * (1 + len(str(a["new"])))
    ),
    "slice": lambda a: as_int(a["slices"]) + len(a["value"]),
    "sum": lambda a: (
        len(a["start"]) + text_size(a["iterable"])
        if isinstance(a["start"], (str, list, tuple))
        else 0
    ),
    "tojson": _json_size,
    "truncate": lambda a: text_size(a["s"]) + len(str(a["end"])),
    "urlize": lambda a: text_size(a["value"]) * (4 + len(str(a["target"])) + len(str(a["rel"]))),
    "wordwrap": lambda a: text_size(a["s"]) * (1 + len(str(a["wrapstring"] or "\n"))),
}
# Filters whose iterable argument is read into a list first, so its items can be counted.
LISTED = {"join": "value", "slice": "value", "sum": "iterable"}

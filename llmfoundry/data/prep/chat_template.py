"""Chat templates (Jinja, as transformers writes them), compiled and rendered within bounds.

A chat template comes with a model folder (`tokenizer_config.json` or `chat_template.jinja`), so
whoever published the folder wrote it: it is a program, and it runs on every chat request the
server answers and every example instruction data prep formats. `ChatTemplate` is the one place
a template is compiled and rendered. It renders the way transformers' `apply_chat_template` does
(the same Jinja options, globals and variables, so a template written for transformers renders
the same), in a sandbox that bounds what the template can reach, how long it runs and how much
it builds:

- Reach: jinja2's `ImmutableSandboxedEnvironment` refuses attributes and methods a template must
  not touch (a `SecurityError`), and the mutating methods of lists and dicts.
- Time: `_StepBudget` stops a rendering after `TEMPLATE_STEPS` lines of the template's compiled
  code. It counts lines, not time, so the same messages fail the same way under any load.
- Memory: every string, list, dict and integer the template builds (operators, `~`, slices,
  literals, filters, method calls) and every piece of its output is charged to a `_SizeBudget`
  of `TEMPLATE_CHARS` characters and items plus four times the text of the messages, *before* it
  is built: `"x" * 10**9` is refused, not allocated. What cannot be known before (the exact
  length of a formatted string) is estimated from above, and the charge is settled to the real
  size after. The charge is cumulative, so a template holds at most that much at any time.
- Compiling: jinja2 folds constant expressions when it compiles, which would build
  `"x" * 10**9` at load, outside any budget. The optimizer is off, and everything that builds
  is charged, so cannot run without a budget (at compile time, there is none).

Whatever a template raises for given messages is a `ChatTemplateError` (a `UserError`); a
template that does not compile is a `UserError` naming where it came from.
"""

from __future__ import annotations

import contextvars
import datetime
import functools
import inspect
import json
import re
import string
import sys
import types
from collections.abc import Callable, ItemsView, KeysView, Mapping, Sequence, ValuesView
from itertools import chain
from types import FrameType
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.runtime import Macro, markup_join, str_join
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace, generate_lorem_ipsum

from llmfoundry.utils.errors import UserError

__all__ = ["TEMPLATE_CHARS", "TEMPLATE_STEPS", "ChatTemplate", "ChatTemplateError"]

# Lines of a template's compiled code one rendering may run: a template over 32 long messages
# runs a few thousand; a million take ~0.2 s.
TEMPLATE_STEPS = 1_000_000
# Characters (and list or dict items) one rendering may build besides 4x its messages' text: a
# prompt is a small fraction of it; held at once it is 16-128 MB (1-8 bytes a unit).
TEMPLATE_CHARS = 1 << 24
MESSAGE_FACTOR = 4  # the output, trimmed copies, a few concatenations of each message
MAX_INT_BITS = 1 << 16  # an integer a template computes (no prompt needs one past 64 bits)
TEMPLATE_FILENAME = "<template>"  # the code jinja2 compiles from a string
PROBE = [{"role": "user", "content": "hi"}]  # what a template is tried on at load


class ChatTemplateError(UserError):
    """The chat template could not render these messages: its own error, or a bound."""


class _StepsSpent(Exception):
    """Raised inside a template's code when its step budget is spent."""


class _SizeSpent(Exception):
    """Raised before a template builds what its size budget cannot pay for (its text: where).
    Not a TypeError or ValueError, which jinja2 and filters catch to try something else."""

    def describe(self, limit: int) -> str:
        return f"more than {limit} characters (at {self})"


class _IntegerTooLarge(_SizeSpent):
    """Raised before a template computes an integer past `MAX_INT_BITS` (its text: which)."""

    def describe(self, limit: int) -> str:
        return str(self)


class _StepBudget:
    """Stops template code in this thread after `steps` lines (`sys.settrace`, which traces
    only the template's frames: the filters and Python code it calls run untraced)."""

    def __init__(self, steps: int) -> None:
        self.left = steps

    def __enter__(self) -> _StepBudget:
        self.previous = sys.gettrace()
        sys.settrace(self._call)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.settrace(self.previous)

    def _call(self, frame: FrameType, event: str, arg: Any) -> Any:
        return self._line if frame.f_code.co_filename == TEMPLATE_FILENAME else None

    def _line(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event == "line":
            self.left -= 1
            if self.left < 0:
                raise _StepsSpent
        return self._line


class _SizeBudget:
    """What a rendering may still build, in characters and items (module docstring: Memory)."""

    def __init__(self, units: int) -> None:
        self.limit = self.left = units

    def charge(self, units: int, what: str) -> None:
        self.left -= units
        if self.left < 0:
            raise _SizeSpent(what)


# The budget of the rendering running in this thread (a context variable: the server renders in
# worker threads). None outside a rendering, where nothing may be built: jinja2's compile-time
# folding then fails and leaves the expression to run, charged, at render time.
_BUDGET: contextvars.ContextVar[_SizeBudget | None] = contextvars.ContextVar(
    "chat_template_budget", default=None
)


def _budget() -> _SizeBudget:
    budget = _BUDGET.get()
    if budget is None:
        raise _SizeSpent("building outside a rendering")
    return budget


def _size_of(value: Any) -> int:
    """What `value` holds, in budget units: characters, items, or bytes of an integer."""
    if isinstance(value, (str, bytes, list, tuple, dict, set, frozenset)):
        return len(value)
    if isinstance(value, int):
        return value.bit_length() // 8
    return 0


def _charged(estimate: int, what: str, build: Callable[[], Any]) -> Any:
    """`build()`, paid for: `estimate` (from above) before, settled to the result's size after."""
    budget = _budget()
    budget.charge(estimate, what)
    result = build()
    budget.charge(_size_of(result) - estimate, what)
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


def _shape(value: Any, limit: int) -> tuple[int, int]:
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


def _text_size(value: Any) -> int:
    """Characters of `str(value)` (an estimate from above, see `_shape`)."""
    if isinstance(value, str):
        return len(value)
    scalar = _scalar_size(value)
    return scalar if scalar is not None else _shape(value, _budget().left)[0]


def _int(value: Any, default: int = 0) -> int:
    return value if isinstance(value, int) else default


_NUMBER = re.compile(r"\d+")
_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d*)(?:\.(\*|\d*))?[hlL]?[a-zA-Z%]")


def _numbers(text: str) -> int:
    """The sum of the numbers written in `text` (widths and precisions of a format)."""
    return sum(int(n) if len(n) < 19 else 1 << 62 for n in _NUMBER.findall(text))


def _format_size(fields: int, numbers: int, fmt: str, values: Sequence[Any]) -> int:
    """A format's output, from above: each field prints the largest value padded to the widths."""
    biggest = max((_text_size(v) for v in values), default=0)
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


def _str_format_size(fmt: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> int:
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


def _method_size(owner: Any, name: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> int:
    """What a method of a string, bytes or integer builds, from above (0: at most its own size,
    settled after the call)."""
    n = len(owner) if isinstance(owner, (str, bytes)) else 0
    if name in ("center", "ljust", "rjust", "zfill"):
        return max(n, _int(_arg(args, kwargs, 0, "width", 0)))
    if name == "expandtabs":
        return n * max(1, _int(_arg(args, kwargs, 0, "tabsize", 8)))
    if name == "replace" and isinstance(owner, str) and len(args) >= 2:
        return _replace_size(owner, args[0], args[1], _arg(args, kwargs, 2, "count", -1))
    if name == "join" and args and isinstance(args[0], list):
        return _text_size(args[0]) + n * len(args[0])
    if name == "translate" and isinstance(owner, str) and args and isinstance(args[0], Mapping):
        longest = max((len(v) for v in args[0].values() if isinstance(v, str)), default=1)
        return n * max(longest, 1)
    if name == "to_bytes":
        return _int(_arg(args, kwargs, 0, "length", 1))
    return 0


def _binop_size(op: str, left: Any, right: Any) -> int:
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
            raise _IntegerTooLarge(
                f"an integer of {bits} bits from '{op}' (at most {MAX_INT_BITS})"
            )
        return bits // 8
    return 0


# Filters that print their value (`str(value)`), and by how much their text can grow.
_PRINTING_FILTERS = {
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
    return value.count("\n") + 1 if isinstance(value, str) else _text_size(value) + 1


def _width(value: Any) -> int:
    return len(value) if isinstance(value, str) else _int(value)


def _json_size(a: Mapping[str, Any]) -> int:
    size, depth = _shape(a["x"], _budget().left)
    separators = a.get("separators") or (", ", ": ")
    grow = 6 if a.get("ensure_ascii") else 1  # \uXXXX
    return size * grow * (1 + depth * _width(a.get("indent")) + sum(map(len, separators)))


# name -> what the filter builds, from above, given its arguments by name (defaults applied).
_FILTER_SIZES: dict[str, Callable[[Mapping[str, Any]], int]] = {
    "batch": lambda a: _int(a["linecount"]) if a["fill_with"] is not None else 0,
    "center": lambda a: max(_text_size(a["value"]), _int(a["width"])),
    "format": lambda a: (
        _percent_size(a["value"], a["kwargs"] or a["args"])
        if isinstance(a["value"], str)
        else _text_size(a["value"])
    ),
    "indent": lambda a: _text_size(a["s"]) + _lines(a["s"]) * _width(a["width"]),
    "join": lambda a: _text_size(a["value"]) + len(str(a["d"])) * len(a["value"]),
    "pprint": lambda a: _text_size(a["value"]) * (1 + _shape(a["value"], _budget().left)[1]),
    "replace": lambda a: (
        _replace_size(a["s"], a["old"], a["new"], a["count"])
        if isinstance(a["s"], str)
        else _text_size(a["s"]) * (1 + len(str(a["new"])))
    ),
    "slice": lambda a: _int(a["slices"]) + len(a["value"]),
    "sum": lambda a: (
        len(a["start"]) + _text_size(a["iterable"])
        if isinstance(a["start"], (str, list, tuple))
        else 0
    ),
    "tojson": _json_size,
    "truncate": lambda a: _text_size(a["s"]) + len(str(a["end"])),
    "urlize": lambda a: _text_size(a["value"]) * (4 + len(str(a["target"])) + len(str(a["rel"]))),
    "wordwrap": lambda a: _text_size(a["s"]) * (1 + len(str(a["wrapstring"] or "\n"))),
}
# Filters whose iterable argument is read into a list first, so its items can be counted.
_LISTED = {"join": "value", "slice": "value", "sum": "iterable"}


def _bounded_filter(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    """`func` (a jinja2 filter), charged for what it builds."""
    signature = inspect.signature(func)  # of the sync function, for jinja2's async variants
    passes_state = getattr(func, "jinja_pass_arg", None) is not None  # context, env first
    # An async variant of a function without state takes an eval context its signature lacks.
    wrapped = getattr(func, "__wrapped__", None)
    extra = int(hasattr(func, "jinja_async_variant") and not hasattr(wrapped, "jinja_pass_arg"))
    size = _FILTER_SIZES.get(name)
    grows = _PRINTING_FILTERS.get(name)

    @functools.wraps(func)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        estimate = 0
        if size is not None:  # its arguments by name
            bound = signature.bind(*args[extra:], **kwargs)
            bound.apply_defaults()
            a = bound.arguments
            if name in _LISTED:
                a[_LISTED[name]] = list(a[_LISTED[name]])
                args, kwargs = (*args[:extra], *bound.args), bound.kwargs
            estimate = size(a)
        elif grows is not None:
            estimate = grows * _text_size(args[1 if passes_state else 0])
        return _charged(estimate, f"filter '{name}'", lambda: func(*args, **kwargs))

    return bounded


def _tojson(x: Any, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """transformers' `tojson`: JSON that keeps `<` and non-ASCII text as they are."""
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(format: str) -> str:
    # C strftime's buffer grows to 256 times the format before it gives up
    return _charged(
        256 * len(format), "strftime_now", lambda: datetime.datetime.now().strftime(format)
    )


def _lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:
    return _charged(
        _int(n) * _int(max) * 16, "lipsum", lambda: generate_lorem_ipsum(n, html, min, max)
    )


class _TemplateDict:
    """`dict` as transformers gives it: a callable that is not the type (no type hackery)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(Namespace):
    """`namespace` as transformers gives it: no attribute that starts with an underscore."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 (jinja2's Namespace's trick)
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"a namespace attribute cannot start with an underscore: {name!r}"
            )


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`, with which transformers marks assistant text:
    its body, rendered as is."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


class _BoundedCodeGenerator(CodeGenerator):
    """jinja2's compiler, with what builds in the template's own code routed through the
    environment's charged methods: `~`, slices, literals and the template's text as output."""

    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        self.write("environment.bounded_concat(context, (")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")

    def visit_Getitem(self, node: nodes.Getitem, frame: Frame) -> None:
        if not isinstance(node.arg, nodes.Slice):
            super().visit_Getitem(node, frame)
            return
        self.write("environment.bounded_slice(")
        self.visit(node.node, frame)
        for part in (node.arg.start, node.arg.stop, node.arg.step):
            self.write(", ")
            if part is None:
                self.write("None")
            else:
                self.visit(part, frame)
        self.write(")")

    def _literal(self, visit: Callable[[Any, Frame], None], node: nodes.Node, frame: Frame) -> None:
        self.write("environment.bounded_literal(")
        visit(node, frame)
        self.write(")")

    def visit_List(self, node: nodes.List, frame: Frame) -> None:
        self._literal(super().visit_List, node, frame)

    def visit_Dict(self, node: nodes.Dict, frame: Frame) -> None:
        self._literal(super().visit_Dict, node, frame)

    def visit_Tuple(self, node: nodes.Tuple, frame: Frame) -> None:
        if node.ctx == "store":  # a loop's or an assignment's target
            super().visit_Tuple(node, frame)
        else:
            self._literal(super().visit_Tuple, node, frame)

    def _output_const_repr(self, group: Any) -> str:
        return f"environment.bounded_text({super()._output_const_repr(group)})"


def _bounded_str(value: Any) -> str:
    """What `{{ value }}` prints, charged (the environment's `finalize`)."""
    return _charged(_text_size(value), "output", lambda: str(value))


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """transformers' chat template environment, with what a template builds charged to the
    rendering's `_SizeBudget` (module docstring)."""

    intercepted_binops = frozenset({"+", "-", "*", "/", "//", "%", "**"})
    code_generator_class = _BoundedCodeGenerator

    def __init__(self) -> None:
        super().__init__(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[_Generation, jinja2.ext.loopcontrols],
            optimized=False,
            finalize=_bounded_str,
        )
        self.filters = {name: _bounded_filter(name, f) for name, f in self.filters.items()}
        self.filters["tojson"] = _bounded_filter("tojson", _tojson)
        self.globals.update(
            raise_exception=_raise_exception,
            strftime_now=_strftime_now,
            dict=_TemplateDict(),
            namespace=_TemplateNamespace,
            lipsum=_lipsum,
        )

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        estimate = _binop_size(operator, left, right)
        return _charged(estimate, f"'{operator}'", lambda: self.binop_table[operator](left, right))

    def call(self, context: Any, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        call = functools.partial(super().call, context, obj)
        if isinstance(obj, Macro):  # its output was charged as it was produced
            return call(*args, **kwargs)
        owner, name = getattr(obj, "__self__", None), getattr(obj, "__name__", "a call")
        wrapped = getattr(obj, "__wrapped__", None)  # the sandbox's str.format
        estimate = 0
        if isinstance(obj, types.BuiltinMethodType) and isinstance(owner, (str, bytes, int)):
            if name == "join" and args:  # read an iterator once, to count and then join it
                args = (list(args[0]), *args[1:])
            estimate = _method_size(owner, name, args, kwargs)
        elif isinstance(getattr(wrapped, "__self__", None), str) and name == "format":
            estimate = _str_format_size(wrapped.__self__, args, kwargs)
        elif isinstance(getattr(wrapped, "__self__", None), str) and name == "format_map":
            estimate = _str_format_size(wrapped.__self__, (), args[0] if args else {})
        return _charged(estimate, name, lambda: call(*args, **kwargs))

    def bounded_concat(self, context: Any, parts: tuple[Any, ...]) -> str:
        join = markup_join if context.eval_ctx.autoescape else str_join
        return _charged(sum(map(_text_size, parts)), "'~'", lambda: join(parts))

    def bounded_slice(self, obj: Any, start: Any, stop: Any, step: Any) -> Any:
        cut = slice(start, stop, step)
        return _charged(_size_of(obj), "a slice", lambda: obj[cut])

    def bounded_literal(self, value: Any) -> Any:
        _budget().charge(len(value), "a literal")
        return value

    def bounded_text(self, text: str) -> str:
        _budget().charge(len(text), "output")
        return text


_ENV = _BoundedSandbox()


class ChatTemplate:
    """A chat template, compiled (a `UserError` naming `where` when it does not compile) and
    tried on a one-word message with `variables` (the special tokens it will be given)."""

    def __init__(self, source: str, where: str, variables: Mapping[str, Any] | None = None) -> None:
        self.source = source
        try:
            self._template = _ENV.from_string(source)
        except jinja2.TemplateSyntaxError as err:
            raise UserError(
                f"the chat template of {where} does not parse: {err.message} (line {err.lineno}); "
                "fix it or use another template"
            ) from None
        except RecursionError:
            raise UserError(
                f"the chat template of {where} nests too deeply to compile; fix it or use another "
                "template"
            ) from None
        self._refuse_building_too_much(where, variables)

    def _refuse_building_too_much(self, where: str, variables: Mapping[str, Any] | None) -> None:
        """A template that builds past its budget for one short message would for every
        conversation (`"x" * 10**9` as a constant): refused now. Its other answers to the probe
        (`raise_exception`, a step budget spent) do not matter: requests report them."""
        try:
            self.render(PROBE, add_generation_prompt=True, variables=variables)
        except ChatTemplateError as err:
            if isinstance(err.__cause__, _SizeSpent):
                raise UserError(
                    f"the chat template of {where} builds {err.__cause__.describe(TEMPLATE_CHARS)} "
                    "for a one-word message; fix it or use another template"
                ) from None

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool,
        variables: Mapping[str, Any] | None = None,
    ) -> str:
        """The text of `messages` under the template, with `add_generation_prompt` and the
        tokenizer's special tokens (`variables`, as transformers passes them); a
        ChatTemplateError when the template cannot render them within its bounds."""
        messages = [dict(m) for m in messages]
        budget = _SizeBudget(TEMPLATE_CHARS + MESSAGE_FACTOR * _shape(messages, sys.maxsize)[0])
        context = {
            **(variables or {}),
            "messages": messages,
            "tools": None,
            "documents": None,
            "add_generation_prompt": add_generation_prompt,
        }
        token = _BUDGET.set(budget)
        try:
            with _StepBudget(TEMPLATE_STEPS):
                return self._template.render(context)
        except _StepsSpent:
            raise ChatTemplateError(
                f"the chat template ran more than {TEMPLATE_STEPS} steps on these messages (loops "
                "within loops?); send fewer messages or fix the template"
            ) from None
        except _SizeSpent as err:
            raise ChatTemplateError(
                f"the chat template built {err.describe(budget.limit)} on these messages; send "
                "shorter messages or fix the template"
            ) from err
        except jinja2.exceptions.SecurityError as err:
            raise ChatTemplateError(
                f"the chat template did something the sandbox forbids: {err}"
            ) from None
        except jinja2.TemplateError as err:  # raise_exception's, e.g. roles that do not alternate
            raise ChatTemplateError(f"the chat template refused these messages: {err}") from None
        except Exception as err:  # a template is a program: its errors are not the caller's
            raise ChatTemplateError(
                f"the chat template failed on these messages ({type(err).__name__}: {err})"
            ) from None
        finally:
            _BUDGET.reset(token)

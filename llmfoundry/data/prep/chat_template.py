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
  literals, filters, method calls) and every piece of its output is charged to a budget
  of `TEMPLATE_CHARS` characters and items plus four times the text of the messages, *before* it
  is built: `"x" * 10**9` is refused, not allocated. What cannot be known before (the exact
  length of a formatted string) is estimated from above, and the charge is settled to the real
  size after (`template_sizes.py`). The charge is cumulative, so a template holds at most
  that much at any time.
- Compiling: jinja2 folds constant expressions when it compiles, which would build
  `"x" * 10**9` at load, outside any budget. The optimizer is off, and everything that builds
  is charged, so cannot run without a budget (at compile time, there is none).

Whatever a template raises for given messages is a `ChatTemplateError` (a `UserError`); a
template that does not compile is a `UserError` naming where it came from.
"""

from __future__ import annotations

import datetime
import functools
import inspect
import json
import sys
import types
from collections.abc import Callable, Mapping, Sequence
from types import FrameType
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.runtime import Macro, markup_join, str_join
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace, generate_lorem_ipsum

from llmfoundry.data.prep.template_sizes import (
    BUDGET,
    FILTER_SIZES,
    LISTED,
    PRINTING_FILTERS,
    SizeBudget,
    SizeSpent,
    as_int,
    binop_size,
    charged,
    current_budget,
    method_size,
    shape,
    size_of,
    str_format_size,
    text_size,
)
from llmfoundry.utils.errors import UserError

__all__ = ["TEMPLATE_CHARS", "TEMPLATE_STEPS", "ChatTemplate", "ChatTemplateError"]

# Lines of a template's compiled code one rendering may run: a template over 32 long messages
# runs a few thousand; a million take ~0.2 s.
TEMPLATE_STEPS = 1_000_000
# Characters (and list or dict items) one rendering may build besides 4x its messages' text: a
# prompt is a small fraction of it; held at once it is 16-128 MB (1-8 bytes a unit).
TEMPLATE_CHARS = 1 << 24
MESSAGE_FACTOR = 4  # the output, trimmed copies, a few concatenations of each message
TEMPLATE_FILENAME = "<template>"  # the code jinja2 compiles from a string
PROBE = [{"role": "user", "content": "hi"}]  # what a template is tried on at load


class ChatTemplateError(UserError):
    """The chat template could not render these messages: its own error, or a bound."""


class _StepsSpent(Exception):
    """Raised inside a template's code when its step budget is spent."""


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


def _bounded_filter(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    """`func` (a jinja2 filter), charged for what it builds."""
    signature = inspect.signature(func)  # of the sync function, for jinja2's async variants
    passes_state = getattr(func, "jinja_pass_arg", None) is not None  # context, env first
    # An async variant of a function without state takes an eval context its signature lacks.
    wrapped = getattr(func, "__wrapped__", None)
    extra = int(hasattr(func, "jinja_async_variant") and not hasattr(wrapped, "jinja_pass_arg"))
    size = FILTER_SIZES.get(name)
    grows = PRINTING_FILTERS.get(name)

    @functools.wraps(func)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        estimate = 0
        if size is not None:  # its arguments by name
            bound = signature.bind(*args[extra:], **kwargs)
            bound.apply_defaults()
            a = bound.arguments
            if name in LISTED:
                a[LISTED[name]] = list(a[LISTED[name]])
                args, kwargs = (*args[:extra], *bound.args), bound.kwargs
            estimate = size(a)
        elif grows is not None:
            estimate = grows * text_size(args[1 if passes_state else 0])
        return charged(estimate, f"filter '{name}'", lambda: func(*args, **kwargs))

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
    return charged(
        256 * len(format), "strftime_now", lambda: datetime.datetime.now().strftime(format)
    )


def _lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:
    return charged(
        as_int(n) * as_int(max) * 16, "lipsum", lambda: generate_lorem_ipsum(n, html, min, max)
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
    return charged(text_size(value), "output", lambda: str(value))


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """transformers' chat template environment, with what a template builds charged to the
    rendering's `SizeBudget` (module docstring)."""

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
        estimate = binop_size(operator, left, right)
        return charged(estimate, f"'{operator}'", lambda: self.binop_table[operator](left, right))

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
            estimate = method_size(owner, name, args, kwargs)
        elif isinstance(getattr(wrapped, "__self__", None), str) and name == "format":
            estimate = str_format_size(wrapped.__self__, args, kwargs)
        elif isinstance(getattr(wrapped, "__self__", None), str) and name == "format_map":
            estimate = str_format_size(wrapped.__self__, (), args[0] if args else {})
        return charged(estimate, name, lambda: call(*args, **kwargs))

    def bounded_concat(self, context: Any, parts: tuple[Any, ...]) -> str:
        join = markup_join if context.eval_ctx.autoescape else str_join
        return charged(sum(map(text_size, parts)), "'~'", lambda: join(parts))

    def bounded_slice(self, obj: Any, start: Any, stop: Any, step: Any) -> Any:
        cut = slice(start, stop, step)
        return charged(size_of(obj), "a slice", lambda: obj[cut])

    def bounded_literal(self, value: Any) -> Any:
        current_budget().charge(len(value), "a literal")
        return value

    def bounded_text(self, text: str) -> str:
        current_budget().charge(len(text), "output")
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
            if isinstance(err.__cause__, SizeSpent):
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
        budget = SizeBudget(TEMPLATE_CHARS + MESSAGE_FACTOR * shape(messages, sys.maxsize)[0])
        context = {
            **(variables or {}),
            "messages": messages,
            "tools": None,
            "documents": None,
            "add_generation_prompt": add_generation_prompt,
        }
        token = BUDGET.set(budget)
        try:
            with _StepBudget(TEMPLATE_STEPS):
                return self._template.render(context)
        except _StepsSpent:
            raise ChatTemplateError(
                f"the chat template ran more than {TEMPLATE_STEPS} steps on these messages (loops "
                "within loops?); send fewer messages or fix the template"
            ) from None
        except SizeSpent as err:
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
            BUDGET.reset(token)

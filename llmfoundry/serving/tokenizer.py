"""The served model's tokenizer: text to ids and back, and chat messages to a prompt.

Encoding and decoding are the ones `scripts/generate.py` uses (`prepare_tokenizer`), so a server
and the command line continue a prompt the same way; completions take any implementation of
`llmfoundry.core.tokenizer.Tokenizer`. Chat needs a chat template (Jinja, as in
transformers): the one of a transformers tokenizer folder (`tokenizer_config.json` or
`chat_template.jinja`), or a file given with `--chat-template`. transformers renders it, so a
template written for transformers works unchanged.

A template is a program, and the server runs it on every chat request, so its work is bounded:
transformers renders it in jinja2's `ImmutableSandboxedEnvironment` (a `SecurityError` for
attributes and methods a template must not reach), and `_StepBudget` stops a rendering after
`TEMPLATE_STEPS` lines of the template's compiled code (nested loops end in a fraction of a
second, not never). Whatever a template raises for given messages (`raise_exception` when roles
do not alternate, the sandbox's refusal, a step budget spent) is a `ChatTemplateError`, which the
server answers with a 400. A template that does not parse is refused at start.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import jinja2

from llmfoundry.core.tokenizer import Tokenizer
from llmfoundry.data.prep.tokenizer import PreparedTokenizer, prepare_tokenizer
from llmfoundry.utils.errors import UserError

__all__ = ["TEMPLATE_STEPS", "ChatTemplateError", "ServedTokenizer", "load_served_tokenizer"]

# Lines of a template's compiled code one rendering may run: a template over 32 long messages
# runs a few thousand; a million take ~0.2 s.
TEMPLATE_STEPS = 1_000_000
TEMPLATE_FILENAME = "<template>"  # the code jinja2 compiles from a string, as transformers does
PROBE = [{"role": "user", "content": "hi"}]  # what a template is tried on at start


class ChatTemplateError(ValueError):
    """The chat template could not render these messages: its own error, or a bound."""


class _StepsSpent(Exception):
    """Raised inside a template's code when its step budget is spent."""


class _StepBudget:
    """Stops template code in this thread after `steps` lines (`sys.settrace`, which traces
    only the template's frames: the filters and transformers' code it calls run untraced).

    Counting lines, not time, makes the bound deterministic: the same messages fail the same
    way under any load.
    """

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


@dataclass(frozen=True)
class ServedTokenizer:
    """`prepared`, any `Tokenizer`, with the chat template the server renders. Templates render
    through transformers, which needs the `tokenizers`-backed `PreparedTokenizer`."""

    prepared: Tokenizer
    chat_template: str | None = None

    def __post_init__(self) -> None:
        if self.prepared.eos_id is None:
            raise UserError(
                f"the served tokenizer ({type(self.prepared).__name__}) has no EOS token; name "
                "one with --eos-token"
            )
        if self.chat_template is not None and not isinstance(self.prepared, PreparedTokenizer):
            raise UserError(
                f"a chat template needs a tokenizer.json tokenizer (transformers renders it), "
                f"not {type(self.prepared).__name__}; serve completions without the template"
            )

    @property
    def eos_id(self) -> int:
        eos_id = self.prepared.eos_id
        assert eos_id is not None  # __post_init__
        return eos_id

    def encode(self, text: str) -> list[int]:
        return self.prepared.encode(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """The ids of each text, as `encode` gives them (in a worker thread of the server:
        `PreparedTokenizer`'s releases the GIL, so the server keeps answering)."""
        return self.prepared.encode_batch(texts)

    def decode(self, ids: list[int]) -> str:
        return self.prepared.decode(ids)

    @functools.cached_property
    def _hf(self):  # the transformers view of the same tokenizer, which renders templates
        from transformers import PreTrainedTokenizerFast

        assert isinstance(self.prepared, PreparedTokenizer)  # __post_init__: with a template

        return PreTrainedTokenizerFast(
            tokenizer_object=self.prepared.tokenizer,
            eos_token=self.prepared.eos_token,
            bos_token=self.prepared.bos_token,
        )

    def render_chat(self, messages: Sequence[dict[str, str]]) -> str:
        """The prompt for `messages` under the chat template, ending where the assistant's
        answer starts (`add_generation_prompt`); a ChatTemplateError when it cannot render them."""
        if self.chat_template is None:
            raise ChatTemplateError(
                "this model's tokenizer has no chat template; use /v1/completions, or start the "
                "server with --chat-template FILE.jinja"
            )
        try:
            return self._render(messages)
        except _StepsSpent:
            raise ChatTemplateError(
                f"the chat template ran more than {TEMPLATE_STEPS} steps on these messages (loops "
                "within loops?); send fewer messages or fix the template"
            ) from None
        except jinja2.exceptions.SecurityError as err:
            raise ChatTemplateError(
                f"the chat template did something the sandbox forbids: {err}"
            ) from None
        except jinja2.TemplateError as err:  # raise_exception's, e.g. roles that do not alternate
            raise ChatTemplateError(f"the chat template refused these messages: {err}") from None
        except Exception as err:  # a template is a program: its errors are not the server's
            raise ChatTemplateError(
                f"the chat template failed on these messages ({type(err).__name__}: {err})"
            ) from None

    def _render(self, messages: Sequence[dict[str, str]]) -> str:
        with _StepBudget(TEMPLATE_STEPS):
            return self._hf.apply_chat_template(
                list(messages),
                chat_template=self.chat_template,
                tokenize=False,
                add_generation_prompt=True,
            )

    def check_template(self, where: str) -> None:
        """Refuse, at start, a chat template that does not parse (a UserError naming `where`
        and the line). Its answer to the probe message does not matter: requests report that."""
        if self.chat_template is None:
            return
        try:
            self._render(PROBE)
        except jinja2.TemplateSyntaxError as err:
            raise UserError(
                f"the chat template of {where} does not parse: {err.message} (line {err.lineno}); "
                "fix it or pass another --chat-template FILE.jinja"
            ) from None
        except Exception:
            pass  # the probe's own refusal; each request gets the template's answer to its messages


def load_served_tokenizer(
    path: str, eos_token: str | None = None, chat_template: str | Path | None = None
) -> ServedTokenizer:
    """The tokenizer at `path` (tokenizer.json or a folder) with its chat template, if any;
    `chat_template` (a Jinja file) overrides the folder's."""
    prepared = prepare_tokenizer(path, eos_token=eos_token)
    if chat_template is not None:
        served = ServedTokenizer(prepared, _read_template(Path(chat_template)))
        served.check_template(str(chat_template))
        return served
    template = None
    if Path(path).is_dir() and (
        Path(path, "tokenizer_config.json").is_file() or Path(path, "chat_template.jinja").is_file()
    ):
        from transformers import AutoTokenizer

        template = AutoTokenizer.from_pretrained(str(path), local_files_only=True).chat_template
    served = ServedTokenizer(prepared, template if isinstance(template, str) else None)
    served.check_template(str(path))
    return served


def _read_template(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except OSError as err:
        raise UserError(
            f"cannot read chat template {path} ({err.strerror}); fix --chat-template"
        ) from None
    except UnicodeDecodeError as err:
        raise UserError(
            f"chat template {path} is not UTF-8 text ({err.reason} at byte {err.start})"
        ) from None

"""The served model's tokenizer: text to ids and back, and chat messages to a prompt.

Encoding and decoding are the ones `scripts/generate.py` uses (`prepare_tokenizer`), so a server
and the command line continue a prompt the same way; completions take any implementation of
`llmfoundry.core.tokenizer.Tokenizer`. Chat needs a chat template (Jinja, as in
transformers): the one of a transformers tokenizer folder (`tokenizer_config.json` or
`chat_template.jinja`), or a file given with `--chat-template`, or, for a checkpoint finetuned in
llmfoundry's default format, that format's template (`trained_chat_template`), so chat prompts
are the tokens it trained on. It renders as transformers would render it, so a template written
for transformers works unchanged.

A template is a program, and the server runs it on every chat request, so it runs in
`llmfoundry.data.prep.chat_template`'s sandbox, which bounds what it reaches, the steps it runs
and what it builds. Whatever a template raises for given messages (`raise_exception` when roles
do not alternate, the sandbox's refusal, a bound) is a `ChatTemplateError`, which the server
answers with a 400. A template that does not parse, or that builds past its bound for one short
message, is refused at start.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import tokenizers

from llmfoundry.core.tokenizer import Tokenizer
from llmfoundry.data.prep.chat_template import TEMPLATE_STEPS, ChatTemplate, ChatTemplateError
from llmfoundry.tokenizers.tokenizer import PreparedTokenizer, prepare_tokenizer
from llmfoundry.utils.errors import UserError

__all__ = ["TEMPLATE_STEPS", "ChatTemplateError", "ServedTokenizer", "load_served_tokenizer"]


@dataclass(frozen=True)
class ServedTokenizer:
    """`prepared`, any `Tokenizer`, with the chat template the server renders. A template needs
    the `tokenizers`-backed `PreparedTokenizer`, which names the special tokens it prints."""

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
                f"a chat template needs a tokenizer.json tokenizer (it names the special tokens), "
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
    def _template(self) -> ChatTemplate:
        assert self.chat_template is not None
        return ChatTemplate(self.chat_template, "the served tokenizer", self._variables)

    @property
    def _variables(self) -> dict[str, str]:
        """The special tokens a template is given (transformers' `special_tokens_map`)."""
        assert isinstance(self.prepared, PreparedTokenizer)  # __post_init__: with a template
        special = {"eos_token": self.prepared.eos_token, "bos_token": self.prepared.bos_token}
        return {name: token for name, token in special.items() if token is not None}

    @functools.cached_property
    def _chat_encoder(self) -> tokenizers.Tokenizer:
        """A copy of the tokenizer that reads the special tokens in a rendered chat prompt (the
        EOS that ends each earlier answer, `<|im_start|>`) as those tokens, as training's
        `Formatter` and transformers do; the served one reads them as text, so that a
        completion prompt's literal `<|endoftext|>` stays text."""
        assert isinstance(self.prepared, PreparedTokenizer)  # __post_init__: with a template
        encoder = tokenizers.Tokenizer.from_str(self.prepared.tokenizer.to_str())
        encoder.encode_special_tokens = False
        return encoder

    def encode_chat(self, prompt: str) -> list[int]:
        """The ids of a prompt `render_chat` gave, special tokens read as such and none added
        (the template writes its own)."""
        [encoding] = self._chat_encoder.encode_batch([prompt], add_special_tokens=False)
        return encoding.ids

    def render_chat(self, messages: Sequence[dict[str, str]]) -> str:
        """The prompt for `messages` under the chat template, ending where the assistant's
        answer starts (`add_generation_prompt`); a ChatTemplateError when it cannot render them."""
        if self.chat_template is None:
            raise ChatTemplateError(
                "this model's tokenizer has no chat template; use /v1/completions, or start the "
                "server with --chat-template FILE.jinja"
            )
        try:
            template = self._template
        except UserError as err:  # made without check_template, which refuses it at start
            raise ChatTemplateError(str(err)) from None
        return template.render(messages, add_generation_prompt=True, variables=self._variables)

    def check_template(self, where: str) -> None:
        """Refuse, at start, a chat template that does not parse or builds past its bound for
        one short message (a UserError naming `where`). Its other answers to that message do
        not matter: each request gets the template's answer to its messages."""
        if self.chat_template is not None:
            ChatTemplate(self.chat_template, where, self._variables)


def load_served_tokenizer(
    path: str,
    eos_token: str | None = None,
    chat_template: str | Path | None = None,
    trained_template: str | None = None,
) -> ServedTokenizer:
    """The tokenizer at `path` (tokenizer.json or a folder) with its chat template: the Jinja
    file `chat_template`, else `trained_template` (the format the model was finetuned in: what
    it knows beats what a folder offers), else the folder's, if any."""
    prepared = prepare_tokenizer(path, eos_token=eos_token)
    if chat_template is not None:
        served = ServedTokenizer(prepared, _read_template(Path(chat_template)))
        served.check_template(str(chat_template))
        return served
    if trained_template is not None:
        served = ServedTokenizer(prepared, trained_template)
        served.check_template("the model's finetune format")
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

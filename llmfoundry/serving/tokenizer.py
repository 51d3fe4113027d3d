"""The served model's tokenizer: text to ids and back, and chat messages to a prompt.

Encoding and decoding are the ones `scripts/generate.py` uses (`prepare_tokenizer`), so a server
and the command line continue a prompt the same way. Chat needs a chat template (Jinja, as in
transformers): the one of a transformers tokenizer folder (`tokenizer_config.json` or
`chat_template.jinja`), or a file given with `--chat-template`. transformers renders it, so a
template written for transformers works unchanged.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from llmfoundry.data.prep.tokenizer import PreparedTokenizer, prepare_tokenizer

__all__ = ["ServedTokenizer", "load_served_tokenizer"]


@dataclass(frozen=True)
class ServedTokenizer:
    prepared: PreparedTokenizer
    chat_template: str | None = None

    @property
    def eos_id(self) -> int:
        return self.prepared.eos_id

    def encode(self, text: str) -> list[int]:
        return self.prepared.tokenizer.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self.prepared.tokenizer.decode(ids)

    @functools.cached_property
    def _hf(self):  # the transformers view of the same tokenizer, which renders templates
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast(
            tokenizer_object=self.prepared.tokenizer,
            eos_token=self.prepared.eos_token,
            bos_token=self.prepared.bos_token,
        )

    def render_chat(self, messages: Sequence[dict[str, str]]) -> str:
        """The prompt for `messages` under the chat template, ending where the assistant's
        answer starts (`add_generation_prompt`)."""
        if self.chat_template is None:
            raise ValueError(
                "this model's tokenizer has no chat template; use /v1/completions, or start the "
                "server with --chat-template FILE.jinja"
            )
        return self._hf.apply_chat_template(
            list(messages),
            chat_template=self.chat_template,
            tokenize=False,
            add_generation_prompt=True,
        )


def load_served_tokenizer(
    path: str, eos_token: str | None = None, chat_template: str | Path | None = None
) -> ServedTokenizer:
    """The tokenizer at `path` (tokenizer.json or a folder) with its chat template, if any;
    `chat_template` (a Jinja file) overrides the folder's."""
    prepared = prepare_tokenizer(path, eos_token=eos_token)
    if chat_template is not None:
        return ServedTokenizer(prepared, Path(chat_template).read_text(encoding="utf-8"))
    template = None
    if Path(path).is_dir() and (
        Path(path, "tokenizer_config.json").is_file() or Path(path, "chat_template.jinja").is_file()
    ):
        from transformers import AutoTokenizer

        template = AutoTokenizer.from_pretrained(str(path), local_files_only=True).chat_template
    return ServedTokenizer(prepared, template if isinstance(template, str) else None)

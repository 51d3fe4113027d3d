"""What generation, evaluation, serving and training's data checks ask of a tokenizer.

They take any object with these members, not the `tokenizers` library's class: the
implementations shipped are `llmfoundry.tokenizers.tokenizer.PreparedTokenizer` (a tokenizer.json
or transformers fast-tokenizer folder through `tokenizers`) and the SentencePiece and tiktoken
ones of `llmfoundry.tokenizers.foreign`, all loaded by `prepare_tokenizer` from one
spec; a test drives the same code with a byte-level one of a dozen lines. Making tokenizer files (training a BPE, data prep's worker
processes, writing a transformers folder on export) stays with `tokenizers` itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable


@runtime_checkable
class Tokenizer(Protocol):
    """Text to token ids and back.

    - `eos_id`: the id ending a document (generation stops at it, data prep appends it), None
      when the tokenizer has none (serving and data prep refuse one); `bos_id`: the id starting
      one, None when the tokenizer has none.
    - `vocab_size`: one more than the largest id `encode` can produce (a model's embedding
      must have at least this many rows).
    - `encode(text, add_special_tokens=True)`: the ids of `text`; special-token text in it
      (``<|endoftext|>`` typed by a user) is plain text, never the special id.
      ``add_special_tokens=False`` leaves out what the tokenizer adds around every input (a BOS
      the template prepends), for text scored as a continuation of other text.
    - `encode_batch(texts)`: `encode` of each (an implementation may run them in parallel).
    - `decode(ids)`: the text of `ids`, special tokens left out.
    - `token_byte_lengths()`: the UTF-8 bytes each id's text takes, indexed by id (0 for
      special tokens), when the bytes of decoded text are the sum over its tokens (a byte-level
      vocabulary); None when they are not (bits per byte are then not reported, not guessed).
    """

    @property
    def eos_id(self) -> int | None: ...

    @property
    def bos_id(self) -> int | None: ...

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def token_byte_lengths(self) -> Sequence[int] | None: ...

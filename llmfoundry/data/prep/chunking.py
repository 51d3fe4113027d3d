"""Cut long documents into pieces a tokenizer encodes to exactly the tokens of the whole.

A tokenizer holds several times a document's size in working memory while it encodes it (a
50 MB document peaked at 8 GB), so a worker's memory would grow with the largest document.
Long documents are therefore encoded piece by piece. A byte-level BPE (GPT-2 style) splits text
into words before merging, and a word never spans a space that is followed by a non-space
character: such a space starts the next word (`` world``) or ends a run of whitespace. Cutting
just before such spaces gives pieces whose tokens, concatenated, are the whole document's.

Other tokenizers (a normalizer that prepends to each input, a Metaspace pre-tokenizer with a
prefix) may not keep that property, so :func:`chunking_is_exact` checks it on a probe text; the
caller encodes documents whole when it fails.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

__all__ = ["chunking_is_exact", "split_document"]

# Every kind of boundary the cut rule meets: runs of spaces, tabs, newlines, CRLF, digits,
# punctuation, contractions, non-ASCII letters and symbols, special-token-like text.
_PROBE = (
    "Hello  world,\tthis is\n\n a test's  'quoted' 123 4567 (x)  \r\n  naïve café ☕ 漢字 "
    "<|endoftext|> end.  \n\tdef f(x):\n    return x * 2  # done\n   trailing   "
)


def _cut(text: str, lo: int, hi: int) -> int | None:
    """A cut position in ``(lo, hi]`` (the last one), else the first after ``hi``, else None.

    A cut position ``p`` has ``text[p] == " "`` and a non-whitespace ``text[p + 1]``.
    """
    p = text.rfind(" ", lo + 1, hi + 1)
    while p != -1:
        if p + 1 < len(text) and not text[p + 1].isspace():
            return p
        p = text.rfind(" ", lo + 1, p)
    p = text.find(" ", hi + 1)
    while p != -1:
        if p + 1 < len(text) and not text[p + 1].isspace():
            return p
        p = text.find(" ", p + 1)
    return None


def split_document(text: str, size: int) -> Iterator[str]:
    """``text`` in pieces of at most ``size`` characters, cut before a space that starts a word.

    A piece is longer only when ``text`` has no such space for more than ``size`` characters.
    """
    start = 0
    while len(text) - start > size:
        cut = _cut(text, start, start + size)
        if cut is None:
            break
        yield text[start:cut]
        start = cut
    yield text[start:]


def chunking_is_exact(encode_batch: Callable[[Sequence[str]], list[list[int]]]) -> bool:
    """Whether encoding :func:`split_document`'s pieces gives the whole text's tokens
    (`encode_batch`: texts to ids, without what a tokenizer adds around each input)."""
    whole = encode_batch([_PROBE])[0]
    for size in (1, 3, 8):
        pieces = encode_batch(list(split_document(_PROBE, size)))
        if [i for ids in pieces for i in ids] != whole:
            return False
    return True

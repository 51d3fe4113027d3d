"""SentencePiece `.model` files, tiktoken `.tiktoken` files and `tiktoken:NAME` through the one
loader (`prepare_tokenizer`), as implementations of the tokenizer protocol; tiny files made here."""

from __future__ import annotations

import json

import numpy as np
import pytest

from llmfoundry.core.tokenizer import Tokenizer
from llmfoundry.data.prep.instructions import Formatter, instructions_to_mds
from llmfoundry.data.prep.text_to_tokens import open_tokens, text_to_tokens
from llmfoundry.data.prep.tokens_to_mds import tokens_to_mds
from llmfoundry.tokenizers.foreign import SentencePieceTokenizer, TiktokenTokenizer
from llmfoundry.tokenizers.tokenizer import prepare_tokenizer
from llmfoundry.utils.errors import MissingInput, UserError
from tests.tokenizer_files import tiny_sentencepiece, tiny_tiktoken

TEXT = "the quick brown fox said hello, héllo wörld"


def test_a_sentencepiece_model_is_a_tokenizer(tmp_path):
    tok = prepare_tokenizer(tiny_sentencepiece(tmp_path))
    assert isinstance(tok, SentencePieceTokenizer) and isinstance(tok, Tokenizer)
    assert (tok.eos_id, tok.eos_token, tok.bos_id, tok.vocab_size) == (2, "</s>", None, 320)
    ids = tok.encode(TEXT)
    assert tok.decode(ids) == TEXT and tok.encode_batch([TEXT, "x"]) == [ids, tok.encode("x")]
    assert tok.eos_id not in tok.encode("a </s> b")  # special-token text is plain text
    assert tok.decode([*ids, tok.eos_id, 320, 999]) == TEXT  # EOS, padded rows left out
    assert tok.token_byte_lengths() is None
    bos = prepare_tokenizer(tmp_path / "tiny.model", eos_token="<unk>", bos_token="<s>")
    assert (bos.eos_id, bos.bos_id) == (0, 1)


def test_a_tiktoken_file_is_a_tokenizer(tmp_path):
    tok = prepare_tokenizer(tiny_tiktoken(tmp_path))
    assert isinstance(tok, TiktokenTokenizer) and isinstance(tok, Tokenizer)
    assert (tok.eos_id, tok.eos_token, tok.vocab_size) == (265, "<|endoftext|>", 266)
    ids = tok.encode(TEXT)
    assert tok.decode(ids) == TEXT and tok.encode_batch([TEXT]) == [ids]
    assert tok.encode("hello the")[0] == 264 and len(tok.encode("hello the")) == 2
    assert tok.eos_id not in tok.encode("a <|endoftext|> b")
    assert tok.decode([*ids, tok.eos_id, 300]) == TEXT
    lengths = tok.token_byte_lengths()
    assert sum(lengths[i] for i in ids) == len(TEXT.encode()) and lengths[tok.eos_id] == 0


@pytest.mark.parametrize(
    ("spec", "error", "message"),
    [
        ("{tmp}/no.model", MissingInput, "tokenizer {tmp}/no.model not found"),
        ("{tmp}/bad.model", UserError, "bad.model is not a SentencePiece model"),
        ("{tmp}/bad.tiktoken", UserError, "bad.tiktoken line 2 is not 'base64-token rank'"),
        ("{tmp}/cl100k_base.tiktoken", UserError, "tiktoken encoding cl100k_base: Hash mismatch"),
        ("tiktoken:nope", UserError, "tiktoken has no encoding 'nope'"),
        ("tiktoken:cl100k_base", MissingInput, "is not in tiktoken's cache (TIKTOKEN_CACHE_DIR="),
    ],
)
def test_bad_specs_are_one_line_errors(spec, error, message, tmp_path, monkeypatch):
    """A name is never downloaded: only tiktoken's cache is read (empty here)."""
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "bad.model").write_bytes(b"not a protobuf at all")
    (tmp_path / "bad.tiktoken").write_text("dGg= 0\nthis is not it\n")
    tiny_tiktoken(tmp_path).rename(tmp_path / "cl100k_base.tiktoken")
    with pytest.raises(error) as raised:
        prepare_tokenizer(spec.format(tmp=tmp_path))
    assert message.format(tmp=tmp_path) in str(raised.value)
    assert "\n" not in str(raised.value)


def test_eos_names_are_checked(tmp_path):
    with pytest.raises(UserError, match="'<nope>' is not in the tokenizer's vocabulary"):
        prepare_tokenizer(tiny_sentencepiece(tmp_path), eos_token="<nope>")
    with pytest.raises(UserError, match="'<nope>' is not a special token of the tokenizer"):
        prepare_tokenizer(tiny_tiktoken(tmp_path), eos_token="<nope>")


@pytest.mark.parametrize("maker", [tiny_sentencepiece, tiny_tiktoken])
def test_text_to_tokens_with_either(maker, tmp_path):
    """Each document's tokens then EOS, in worker processes too; the tokenizer file is saved
    beside the tokens under a name that loads it again, and tokens_to_mds.py copies it."""
    docs = {"a.txt": TEXT, "b.txt": "hello the lazy dog " * 300}
    (tmp_path / "docs").mkdir()
    for name, text in docs.items():
        (tmp_path / "docs" / name).write_text(text)
    tok = prepare_tokenizer(maker(tmp_path))
    want = [i for text in docs.values() for i in [*tok.encode(text), tok.eos_id]]
    for workers in (1, 2):
        out = tmp_path / f"out{workers}" / "t.bin"
        meta = text_to_tokens([str(tmp_path / "docs")], out, tokenizer=tok.spec, workers=workers,
                              chunk_chars=64, progress=False)  # fmt: skip
        assert np.asarray(open_tokens(out)[0]).tolist() == want
        assert (meta["eos_id"], meta["vocab_size"]) == (tok.eos_id, tok.vocab_size)
        again = prepare_tokenizer(out.parent / meta["tokenizer"])
        assert again.encode(TEXT) == tok.encode(TEXT) and again.eos_id == tok.eos_id
    mds = tokens_to_mds(out, str(tmp_path / "mds"), 16, progress=False)
    assert mds["tokenizer"] == meta["tokenizer"] and mds["eos_id"] == tok.eos_id
    assert prepare_tokenizer(tmp_path / "mds" / mds["tokenizer"]).encode(TEXT) == tok.encode(TEXT)


@pytest.mark.parametrize("maker", [tiny_sentencepiece, tiny_tiktoken])
def test_instructions_to_mds_with_either(maker, tmp_path):
    """The default format's pieces encoded with the tokenizer, EOS after each response; the
    tokenizer file is written beside the shards and named in meta.json."""
    tok = prepare_tokenizer(maker(tmp_path))
    chat = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "the fox"}]
    (tmp_path / "chats.jsonl").write_text(json.dumps({"messages": chat}) + "\n")
    ids, labels = Formatter(tok.spec).encode(chat)
    prompt, answer = tok.encode("### User:\nhello\n\n### Assistant:\n"), tok.encode("the fox")
    assert ids.tolist() == [*prompt, *answer, tok.eos_id]
    assert labels.tolist() == [-100] * len(prompt) + [*answer, tok.eos_id]
    meta = instructions_to_mds([str(tmp_path / "chats.jsonl")], str(tmp_path / "mds"), tok.spec, 32)
    assert meta["eos_id"] == tok.eos_id and meta["vocab_size"] == tok.vocab_size
    again = prepare_tokenizer(tmp_path / "mds" / meta["tokenizer"])
    assert again.encode("hello the fox") == tok.encode("hello the fox")

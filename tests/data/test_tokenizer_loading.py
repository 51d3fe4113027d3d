"""One tokenizer loader for data prep and training: files, folders, URLs, transformers folders."""

import json

import fsspec
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from llmfoundry.callbacks import Generate
from llmfoundry.data.prep import load_tokenizer, prepare_tokenizer, train_bpe

TEXTS = ["def main():\n    return 0\n", "class A:\n    pass\n"] * 20


@pytest.fixture(scope="module")
def tok_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_bpe(TEXTS, vocab_size=300).save(str(path))
    return path


def test_file_folder_and_url_load_the_same_tokenizer(tok_file):
    want = load_tokenizer(tok_file).to_str()
    assert load_tokenizer(tok_file.parent).to_str() == want
    with fsspec.open("memory://tok/tokenizer.json", "w") as f:
        f.write(want)
    assert load_tokenizer("memory://tok/tokenizer.json").to_str() == want
    with pytest.raises(FileNotFoundError, match="memory://tok/missing.json not found"):
        load_tokenizer("memory://tok/missing.json")


def test_generate_reads_the_tokenizer_from_a_url(tok_file):
    with fsspec.open("memory://gen/tokenizer.json", "w") as f:
        f.write(tok_file.read_text())
    callback = Generate(tokenizer="memory://gen/tokenizer.json", prompts=["def "])
    assert callback.tokenizer.encode("def main") == load_tokenizer(tok_file).encode("def main").ids


def test_folder_without_endoftext_takes_its_configured_eos(tmp_path):
    tok = Tokenizer(models.WordLevel({"a": 0, "b": 1, "</s>": 2}, unk_token="a"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ValueError, match="no eos_token"):
        prepare_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "</s>"}}))
    prepared = prepare_tokenizer(tmp_path)
    assert (prepared.eos_token, prepared.eos_id) == ("</s>", 2)

"""Where the served tokenizer's chat template comes from, and how it renders messages."""

from __future__ import annotations

import pytest
from transformers import PreTrainedTokenizerFast

from llmfoundry.serving.tokenizer import load_served_tokenizer
from llmfoundry.tokenizers.tokenizer import EOS_TOKEN, train_bpe
from tests.serving.conftest import CHAT_TEMPLATE, TEXTS

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
RENDERED = "<system>be brief\n<user>hi\n<assistant>"


@pytest.fixture
def tokenizer_json(tmp_path):
    path = tmp_path / "tokenizer.json"
    train_bpe(TEXTS, vocab_size=300).save(str(path))
    return path


def test_a_transformers_folder_brings_its_template(tokenizer_json, tmp_path):
    folder = tmp_path / "hf"
    hf = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_json), eos_token=EOS_TOKEN)
    hf.chat_template = CHAT_TEMPLATE
    hf.save_pretrained(folder)
    served = load_served_tokenizer(str(folder))
    assert served.chat_template == CHAT_TEMPLATE
    assert served.render_chat(MESSAGES) == RENDERED
    assert served.decode(served.encode(RENDERED)) == RENDERED


def test_tokenizer_json_has_none_unless_given(tokenizer_json, tmp_path):
    with pytest.raises(ValueError, match="no chat template.*--chat-template"):
        load_served_tokenizer(str(tokenizer_json)).render_chat(MESSAGES)
    template = tmp_path / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    assert (
        load_served_tokenizer(str(tokenizer_json), chat_template=template).render_chat(MESSAGES)
        == RENDERED
    )

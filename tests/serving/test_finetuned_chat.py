"""Chat with a model finetuned in the default format: the checkpoint and its export are served
with that format's chat template (llmfoundry/data/prep/templates/default_finetune.jinja), whose
prompts are the very tokens the finetuning data holds."""

from __future__ import annotations

import json

import numpy as np
import pytest

from llmfoundry.build import build_trainer
from llmfoundry.checkpoint.pretrained import read_pretrained, save_weights
from llmfoundry.config.preflight import compose_config
from llmfoundry.data.prep.instructions import (
    DEFAULT_FORMAT_TEMPLATE,
    IGNORE,
    Formatter,
    trained_chat_template,
)
from llmfoundry.serving.tokenizer import ServedTokenizer
from llmfoundry.tokenizers.tokenizer import prepare_tokenizer
from tests.e2e.test_finetune import CONF, SEQ, VOCAB, _instruction_data, tiny
from tests.models.test_hf_scripts import script
from tests.serving.conftest import running_server

CONVERSATION = [
    {"role": "system", "content": "Answer in words."},
    {"role": "user", "content": "def f3(x):"},
    {"role": "assistant", "content": "Return x times 3."},
    {"role": "user", "content": "def f4(x):"},
    {"role": "assistant", "content": "Return x times 4."},
]


@pytest.fixture(scope="module")
def finetuned(tmp_path_factory):
    """A tiny model finetuned two batches on default-format instruction data (ft/ckpt), the
    instruction data and its tokenizer."""
    tmp = tmp_path_factory.mktemp("finetuned")
    data, tokenizer = _instruction_data(tmp)
    save_weights(tiny(seed=3), str(tmp / "base"), tokenizer)
    overrides = [
        "+experiment=finetune",
        f"load_path={tmp / 'base'}",
        f"data.remote={data}",
        f"tokenizer={tokenizer}",
        "model.d_model=32", "model.n_heads=2", "model.n_layers=2",
        f"model.max_seq_len={SEQ}", f"model.vocab_size={VOCAB}",
        "global_train_batch_size=4", "device_eval_batch_size=4", "max_duration=2ba",
        "eval_interval=2ba", "eval_subset_num_batches=1", "save_interval=2ba",
        "callbacks=[]", "loggers=[]", f"save_folder={tmp / 'ft' / 'ckpt'}",
    ]  # fmt: skip
    build_trainer(compose_config(CONF, overrides), tmp / "run").fit()
    return tmp, data, tokenizer


def test_the_default_template_prompts_with_the_tokens_finetuning_trained_on(finetuned):
    tmp, data, tokenizer = finetuned
    ids, labels = Formatter(tokenizer).encode(CONVERSATION)
    answer_start = len(labels) - int(np.argmax(labels[::-1] == IGNORE))  # the last answer's
    template = DEFAULT_FORMAT_TEMPLATE.read_text(encoding="utf-8")
    served = ServedTokenizer(prepare_tokenizer(tokenizer), template)
    prompt = served.render_chat(CONVERSATION[:-1])
    assert prompt.endswith("### User:\ndef f4(x):\n\n### Assistant:\n")
    assert served.encode_chat(prompt) == ids[:answer_start].tolist()
    # and the whole conversation, answers and their EOS included
    full = served._template.render(CONVERSATION, False, served._variables)
    assert served.encode_chat(full) == ids.tolist()


def test_only_default_format_data_gives_the_template(finetuned, tmp_path, caplog):
    tmp, data, _ = finetuned
    assert trained_chat_template({"remote": str(data)}) == DEFAULT_FORMAT_TEMPLATE.read_text()
    assert trained_chat_template({"streams": {"a": {"remote": str(data)}}}) is not None
    meta = json.loads((data / "meta.json").read_text())
    (tmp_path / "meta.json").write_text(json.dumps({**meta, "chat_template": True}))
    assert trained_chat_template({"remote": str(tmp_path)}) is None  # the tokenizer's own
    (tmp_path / "meta.json").write_text(json.dumps({"format": "llmfoundry.mds-tokens"}))
    assert trained_chat_template({"remote": str(tmp_path)}) is None  # pretraining data
    assert trained_chat_template({"remote": str(tmp_path / "gone")}) is None
    assert "--chat-template" in caplog.text and "default_finetune.jinja" in caplog.text


def test_the_finetuned_checkpoint_answers_chat_in_process(finetuned):
    """serve.py's wiring in this process (no subprocess): the checkpoint's format reaches the
    app, and a chat request is answered."""
    from starlette.testclient import TestClient

    from llmfoundry.serving.app import Limits, create_app
    from llmfoundry.serving.engine import Engine
    from llmfoundry.serving.tokenizer import load_served_tokenizer

    tmp, _, _ = finetuned
    loaded = read_pretrained(str(tmp / "ft" / "ckpt"))
    assert loaded.chat_template == DEFAULT_FORMAT_TEMPLATE.read_text(encoding="utf-8")
    tokenizer = load_served_tokenizer(loaded.tokenizer, trained_template=loaded.chat_template)
    engine = Engine(loaded.model, tokenizer.decode, max_rows=2, max_len=2 * SEQ)
    app = create_app(engine, tokenizer, "ft", Limits(SEQ - 4, 4, 1 << 16, 2), SEQ)
    with TestClient(app) as client:
        body = {"messages": CONVERSATION[1:2], "max_tokens": 4, "temperature": 0}
        response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    prompt = tokenizer.encode_chat(tokenizer.render_chat(CONVERSATION[1:2]))
    assert response.json()["usage"]["prompt_tokens"] == len(prompt)


@pytest.mark.slow  # two server starts and an export, each loading torch in a subprocess
def test_chat_with_the_finetuned_checkpoint_and_its_export(finetuned):
    import httpx

    openai = pytest.importorskip("openai")
    tmp, _, _ = finetuned
    template = DEFAULT_FORMAT_TEMPLATE.read_text(encoding="utf-8")
    assert read_pretrained(str(tmp / "ft" / "ckpt")).chat_template == template
    assert script("export_hf")([str(tmp / "ft" / "ckpt"), str(tmp / "hf" / "ckpt")]) == 0
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(str(tmp / "hf" / "ckpt")).chat_template == template
    body = {"messages": CONVERSATION[1:2], "max_tokens": 4, "temperature": 0}
    for served in (tmp / "ft", tmp / "hf"):  # running_server serves <folder>/ckpt
        with running_server(served) as (url, _):
            response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
            assert response.status_code == 200, response.text
            answer = response.json()
            assert answer["choices"][0]["message"]["role"] == "assistant"
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0)
            out = client.chat.completions.create(model=answer["model"], **body)
            assert out.choices[0].message.content == answer["choices"][0]["message"]["content"]

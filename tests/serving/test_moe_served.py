"""A mixture-of-experts model through the OpenAI server: a weights checkpoint of a tiny
Qwen3-MoE loads (its family from the config it records), and /v1/completions answers two prompts
batched together with what greedy decoding gives each alone. The app runs in-process
(TestClient), over the engine."""

from __future__ import annotations

import pytest
import torch

from llmfoundry.checkpoint.pretrained import read_pretrained, save_weights
from llmfoundry.models.families import build_model
from llmfoundry.models.generation import GenerationConfig, generate
from llmfoundry.models.qwen3_moe import Qwen3MoeConfig, Qwen3MoeForCausalLM
from llmfoundry.serving.tokenizer import load_served_tokenizer
from llmfoundry.tokenizers.tokenizer import prepare_tokenizer, train_bpe
from tests.serving.conftest import CONTEXT, TEXTS

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from llmfoundry.serving.app import Limits, create_app  # noqa: E402
from llmfoundry.serving.engine import Engine  # noqa: E402

RUN_NAME = "tiny-moe"


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    """A tied tiny Qwen3-MoE whose EOS embedding row is zero (the tied EOS logit is 0 while the
    others spread around it: greedy decoding never stops early)."""
    tmp = tmp_path_factory.mktemp("moe")
    train_bpe(TEXTS, vocab_size=300).save(str(tmp / "tokenizer.json"))
    tokenizer = prepare_tokenizer(tmp / "tokenizer.json")
    config = Qwen3MoeConfig.preset(
        "qwen3-moe-tiny",
        d_model=64,
        n_layers=2,
        n_experts=8,
        top_k=2,
        expert_hidden=32,
        vocab_size=tokenizer.vocab_size,
        max_seq_len=CONTEXT,
        tie_word_embeddings=True,
        init_std=0.1,
    )
    torch.manual_seed(0)
    model = build_model(config)
    with torch.no_grad():
        model.transformer.wte.weight[tokenizer.eos_id] = 0
    save_weights(model, str(tmp / "ckpt"), tmp / "tokenizer.json", run_name=RUN_NAME)
    return tmp / "ckpt"


def test_a_moe_checkpoint_is_served_as_generate_decodes_it(moe_checkpoint):
    loaded = read_pretrained(str(moe_checkpoint))
    assert isinstance(loaded.model, Qwen3MoeForCausalLM) and loaded.run_name == RUN_NAME
    tokenizer = load_served_tokenizer(loaded.tokenizer)
    engine = Engine(loaded.model, tokenizer.decode, max_rows=4, max_len=CONTEXT)
    app = create_app(engine, tokenizer, RUN_NAME, Limits(max_concurrent=4), CONTEXT)
    prompts = ["def add(a, b):", "hello world"]
    with TestClient(app) as client:
        response = client.post(
            "/v1/completions",
            json={"model": RUN_NAME, "prompt": prompts, "max_tokens": 10, "temperature": 0},
        )
    assert response.status_code == 200, response.text
    choices = sorted(response.json()["choices"], key=lambda c: c["index"])
    greedy = GenerationConfig(max_new_tokens=10, temperature=0.0)
    for prompt, choice in zip(prompts, choices, strict=True):
        ids = torch.tensor([tokenizer.encode(prompt)])
        alone = generate(loaded.model, ids, None, greedy, decode=tokenizer.decode)
        assert choice["text"] == alone.texts[0] and choice["finish_reason"] == "length"

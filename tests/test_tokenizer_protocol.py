"""Generation, ICL evaluation and serving take any `llmfoundry.core.tokenizer.Tokenizer`: driven
here with a byte-level tokenizer of a dozen lines that has nothing of the `tokenizers` library."""

from __future__ import annotations

import json
import logging
import types
from collections.abc import Sequence

import pytest
import torch

from llmfoundry.callbacks import Generate
from llmfoundry.core.precision import Precision
from llmfoundry.core.tokenizer import Tokenizer
from llmfoundry.data.prep import PreparedTokenizer, train_bpe
from llmfoundry.distributed.single import SingleDevice
from llmfoundry.eval.icl import evaluate_tasks, load_task
from llmfoundry.models.generation import GenerationConfig, generate, left_pad
from llmfoundry.models.mpt import MPTConfig, MPTForCausalLM
from llmfoundry.tokenizers.tokenizer import prepare
from llmfoundry.utils.errors import UserError

EOS = 256


class ByteTokenizer:
    """UTF-8 bytes are ids 0-255; 256 is EOS."""

    eos_id = EOS
    bos_id = None
    vocab_size = 257

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(text) for text in texts]

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if i != EOS).decode("utf-8", errors="replace")

    def token_byte_lengths(self) -> list[int]:
        return [1] * 256 + [0]


@pytest.fixture(scope="module")
def model() -> MPTForCausalLM:
    torch.manual_seed(0)
    config = MPTConfig(d_model=32, n_heads=2, n_layers=2, max_seq_len=64, vocab_size=257)
    return MPTForCausalLM(config).eval()


def greedy(model, prompt: str, max_new_tokens: int, stop: tuple[str, ...] = ()) -> str:
    ids = torch.tensor([ByteTokenizer().encode(prompt)])
    config = GenerationConfig(max_new_tokens=max_new_tokens, temperature=0.0, stop=stop)
    return generate(model, ids, None, config, decode=ByteTokenizer().decode).texts[0]


def test_both_implementations_are_tokenizers():
    prepared = prepare(train_bpe(["hello world"] * 10, 300))
    assert isinstance(ByteTokenizer(), Tokenizer) and isinstance(prepared, Tokenizer)
    assert isinstance(prepared, PreparedTokenizer)
    assert prepared.encode("hello") and prepared.decode(prepared.encode("hello")) == "hello"
    assert not isinstance(object(), Tokenizer)


def test_the_generate_callback_samples_with_any_tokenizer(model, caplog):
    prompts = ["ab", "héllo"]
    callback = Generate(ByteTokenizer(), prompts, max_new_tokens=4, temperature=0)
    with caplog.at_level(logging.INFO, logger="llmfoundry.callbacks.generate"):
        cpu = torch.device("cpu")
        state = types.SimpleNamespace(
            model=model, strategy=SingleDevice("cpu"), precision=Precision("fp32", cpu)
        )
        callback.fit_end(state, logger=None)
    logged = "\n".join(r.getMessage() for r in caplog.records) + "\n"
    ids, mask = left_pad([ByteTokenizer().encode(p) for p in prompts])
    out = generate(model, ids, mask, GenerationConfig(max_new_tokens=4, temperature=0))
    for prompt, tokens in zip(prompts, out.tokens, strict=True):
        text = ByteTokenizer().decode(tokens)
        assert f"--- sample (prompt {prompt!r}) ---\n{prompt}{text}\n" in logged


def test_icl_evaluation_scores_every_kind_with_any_tokenizer(model, tmp_path):
    answer = greedy(model, "Q: cat\nA:", 32, stop=("\n",)).strip()  # as icl.py decodes
    rows = {
        "qa": [{"question": "cat", "answer": [answer]}, {"question": "cat", "answer": "not it"}],
        "mc": [{"query": "x", "choices": ["y", "z"], "gold": 0}] * 2,
        "lm": [{"context": "x", "continuation": "y"}] * 2,
    }
    tasks = []
    for name, examples in rows.items():
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(f"{json.dumps(r)}\n" for r in examples))
        tasks.append(load_task(str(path)))
    results = evaluate_tasks(model, ByteTokenizer(), tasks)
    assert results["qa"]["correct"] == 1
    # A bigram "model" (logits depend on the current byte only) that follows x with y.
    table = torch.zeros(257, 257)
    table[ord("x"), ord("y")] = 5.0
    scored = evaluate_tasks(
        model, ByteTokenizer(), tasks[1:], forward=lambda ids, reduce: reduce(table[ids])
    )
    assert scored["mc"]["accuracy"] == 1.0 and scored["lm"]["accuracy"] == 1.0
    small = MPTForCausalLM(MPTConfig(d_model=32, n_heads=2, n_layers=1, vocab_size=200))
    with pytest.raises(ValueError, match="the tokenizer has 257 tokens, more than"):
        evaluate_tasks(small, ByteTokenizer(), tasks)


def test_the_server_completes_with_any_tokenizer(model):
    pytest.importorskip("fastapi")
    from starlette.testclient import TestClient

    from llmfoundry.serving.app import Limits, create_app
    from llmfoundry.serving.engine import Engine
    from llmfoundry.serving.tokenizer import ServedTokenizer

    tokenizer = ServedTokenizer(ByteTokenizer())
    engine = Engine(model, tokenizer.decode, max_rows=2, max_len=64)
    app = create_app(engine, tokenizer, "bytes", Limits(max_prompt_tokens=32, max_tokens=8), 64)
    with TestClient(app, raise_server_exceptions=False) as client:
        body = {"prompt": ["ab", "cd"], "max_tokens": 6, "temperature": 0}
        response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    texts = [choice["text"] for choice in response.json()["choices"]]
    assert texts == [greedy(model, "ab", 6), greedy(model, "cd", 6)]
    with pytest.raises(UserError, match="a chat template needs a tokenizer.json tokenizer"):
        ServedTokenizer(ByteTokenizer(), chat_template="{{ messages }}")

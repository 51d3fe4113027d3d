"""/v1/completions as a scorer: token-id prompts, `echo` with `logprobs` (the prompt's own
log-probabilities, as lm-evaluation-harness's `local-completions` reads them) and `n` choices.
The app runs in-process (TestClient), over the engine and the tiny served model."""

from __future__ import annotations

import pytest
import torch

from llmfoundry.checkpoint.pretrained import read_pretrained
from llmfoundry.serving.tokenizer import load_served_tokenizer
from tests.serving.conftest import CONTEXT, RUN_NAME

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from llmfoundry.serving.app import Limits, create_app  # noqa: E402
from llmfoundry.serving.engine import Engine  # noqa: E402


@pytest.fixture(scope="module")
def served(served_model):
    loaded = read_pretrained(str(served_model / "ckpt"))
    tokenizer = load_served_tokenizer(loaded.tokenizer)
    engine = Engine(loaded.model, tokenizer.decode, max_rows=8, max_len=2 * CONTEXT)
    app = create_app(engine, tokenizer, loaded.run_name, Limits(max_concurrent=8), CONTEXT)
    with TestClient(app) as client:
        yield client, loaded.model, tokenizer


def complete(client, **body):
    response = client.post("/v1/completions", json={"model": RUN_NAME, **body})
    assert response.status_code == 200, response.text
    return response.json()


def test_echo_logprobs_are_the_prompts_own(served):
    client, model, tokenizer = served
    ids = tokenizer.encode("def add(a, b):\n    return a + b")
    body = complete(client, prompt=[ids], echo=True, logprobs=1, max_tokens=1, temperature=0)
    (choice,) = body["choices"]
    logprobs = choice["logprobs"]
    with torch.no_grad():
        expected = model(torch.tensor([ids]))[0].float().log_softmax(dim=-1)
    token_logprobs = logprobs["token_logprobs"]
    assert len(token_logprobs) == len(ids) + 1 and token_logprobs[0] is None  # + the new token
    scored = expected[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert torch.allclose(torch.tensor(token_logprobs[1 : len(ids)]), scored, atol=1e-5)
    new = int(expected[-1].argmax())  # greedy: the new token is the most likely one
    assert token_logprobs[-1] == pytest.approx(float(expected[-1, new]), abs=1e-5)
    assert logprobs["tokens"] == [tokenizer.decode([t]) for t in [*ids, new]]
    assert choice["text"] == tokenizer.decode(ids) + tokenizer.decode([new])
    for position, top in enumerate(logprobs["top_logprobs"][1:], start=1):
        best = int(expected[position - 1].argmax())
        assert top[tokenizer.decode([best])] == pytest.approx(float(expected[position - 1, best]))
    assert logprobs["text_offset"][:3] == [
        0,
        len(logprobs["tokens"][0]),
        len("".join(logprobs["tokens"][:2])),
    ]
    plain = complete(client, prompt="def add(", max_tokens=3, temperature=0, logprobs=0)
    assert len(plain["choices"][0]["logprobs"]["token_logprobs"]) == 3  # the new tokens only
    assert plain["choices"][0]["logprobs"]["text_offset"][0] == len("def add(")


def test_lm_eval_reads_the_scores(served):
    """lm-eval's own parser of local-completions answers, on ours (lm_eval: a dev extra)."""
    from lm_eval.models import openai_completions as completions

    client, model, tokenizer = served
    context, choice = tokenizer.encode("hello world,"), tokenizer.encode(" hello server")
    body = complete(
        client,
        prompt=[context + choice],
        echo=True,
        logprobs=1,
        max_tokens=1,
        temperature=0,
        seed=1234,
    )
    ((total, greedy),) = completions.LocalCompletionsAPI.parse_logprobs(
        body, ctxlens=[len(context)]
    )
    with torch.no_grad():
        expected = model(torch.tensor([context + choice]))[0].float().log_softmax(dim=-1)
    rows = expected[len(context) - 1 : -1]
    assert total == pytest.approx(
        float(rows.gather(1, torch.tensor(choice)[:, None]).sum()), abs=1e-4
    )
    assert greedy == bool((rows.argmax(dim=-1) == torch.tensor(choice)).all())


def test_n_choices_per_prompt(served):
    client, _, _ = served
    greedy = complete(client, prompt=["import", "the"], n=2, max_tokens=6, temperature=0)
    texts = [c["text"] for c in sorted(greedy["choices"], key=lambda c: c["index"])]
    assert [c["index"] for c in greedy["choices"]] == [0, 1, 2, 3]
    assert texts[0] == texts[1] != texts[2] == texts[3]  # choice i * n + j: prompt i
    assert greedy["usage"]["completion_tokens"] == 24
    sampled = complete(client, prompt="import", n=3, max_tokens=8, temperature=1.0, seed=7)
    again = complete(client, prompt="import", n=3, max_tokens=8, temperature=1.0, seed=7)
    texts = [c["text"] for c in sampled["choices"]]
    assert texts == [c["text"] for c in again["choices"]] and len(set(texts)) == 3
    for body, message in [
        ({"n": 2, "stream": True}, "n > 1 is served without stream"),
        ({"echo": True, "logprobs": 1, "stream": True}, "served without stream"),
        ({"logprobs": 6}, "logprobs"),
        ({"prompt": [[1, -2]]}, "prompt"),
        ({"n": 10**9}, "at most 8"),  # refused before anything is built for it
        ({"logprobs": True}, "logprobs: Input should be a valid integer"),  # not logprobs=1
        ({"prompt": [[True, 5]]}, "prompt"),  # not the ids [1, 5]
    ]:
        response = client.post("/v1/completions", json={"prompt": "hi", **body})
        assert response.status_code == 400 and message in response.json()["error"]["message"]


def test_a_long_prompt_is_scored_a_chunk_of_positions_at_a_time(served, monkeypatch):
    """echo + logprobs over a prompt of 600 tokens: the same scores as one log_softmax over all
    positions, computed PROMPT_SCORE_CHUNK positions at a time (before: a float32 copy of the
    whole [prompt, vocab] logits per prompt scored, 0.5 GB at 1k tokens and a 128k vocab)."""
    from llmfoundry.models import generation

    scored_rows = []
    entries = generation._entries

    def spy(logprobs, tokens, k):
        scored_rows.append(logprobs.shape[0])
        return entries(logprobs, tokens, k)

    monkeypatch.setattr(generation, "_entries", spy)
    client, model, _ = served
    ids = [(7 * i) % 250 + 3 for i in range(600)]
    body = complete(client, prompt=[ids], echo=True, logprobs=2, max_tokens=1, temperature=0)
    assert max(scored_rows) < len(ids) - 1, "the whole prompt's positions scored at once"
    assert max(scored_rows) <= generation.PROMPT_SCORE_CHUNK
    with torch.no_grad():
        expected = model(torch.tensor([ids]))[0].float().log_softmax(dim=-1)
    token_logprobs = body["choices"][0]["logprobs"]["token_logprobs"]
    scored = expected[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert torch.allclose(torch.tensor(token_logprobs[1 : len(ids)]), scored, atol=1e-5)

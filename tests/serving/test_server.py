"""scripts/serve.py as a client sees it: the real server on a loopback port, the openai client.

One server (API key, chat template, small limits) serves most tests; a second one without a key
or template checks the chat refusal and draining on SIGTERM.
"""

from __future__ import annotations

import importlib.util
import json
import signal
import threading
import time
from collections.abc import Iterator

import pytest

from llmfoundry.checkpoint.pretrained import load_pretrained
from llmfoundry.models.generation import GenerationConfig, generate, left_pad
from llmfoundry.serving.engine import stream_safe_length
from llmfoundry.tokenizers.tokenizer import prepare_tokenizer
from tests.serving.conftest import API_KEY, CONTEXT, ROOT, RUN_NAME, running_server

pytestmark = pytest.mark.slow  # each server start loads torch in a subprocess
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

MODEL = RUN_NAME  # the served model's id: the run the checkpoint records, not its folder's name
MAX_CONCURRENT = 3
LIMITS = ["--max-concurrent", "3", "--max-prompt-tokens", "64", "--max-tokens", "1000"]
LIMITS += ["--max-body-bytes", "4096"]


@pytest.fixture(scope="module")
def server(served_model):
    chat = ["--chat-template", str(served_model / "chat.jinja")]
    with running_server(served_model, *LIMITS, *chat, api_key=API_KEY) as (url, _):
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference(served_model):
    """Greedy continuations computed in-process with the library's `generate`."""
    model, tokenizer_path = load_pretrained(str(served_model / "ckpt"))
    tokenizer = prepare_tokenizer(tokenizer_path)

    def continue_(prompts: list[str], max_tokens: int) -> list[str]:
        ids, mask = left_pad([tokenizer.tokenizer.encode(p).ids for p in prompts])
        config = GenerationConfig(max_tokens, temperature=0, eos_token_id=tokenizer.eos_id)
        return generate(model, ids, mask, config, decode=tokenizer.tokenizer.decode).texts

    return continue_


def eval_script():
    spec = importlib.util.spec_from_file_location("eval_script", ROOT / "scripts" / "eval.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def post(
    server: str, path: str, body, key: str | None = API_KEY, timeout: float = 60
) -> httpx.Response:
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    if not isinstance(body, bytes | str):
        body = json.dumps(body)
    headers["content-type"] = "application/json"
    return httpx.post(f"{server}{path}", content=body, headers=headers, timeout=timeout)


def metrics(server: str) -> dict:
    response = httpx.get(f"{server}/metrics", headers={"Authorization": f"Bearer {API_KEY}"})
    response.raise_for_status()
    return response.json()


def test_health_and_models(server, client):
    assert httpx.get(f"{server}/health").json() == {"status": "ok"}  # no key needed: probes
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_auth_is_required_and_checked(server, served_model):
    for key in (None, "wrong-key"):
        response = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2}, key=key)
        assert response.status_code == 401, response.text
        assert "API key" in response.json()["error"]["message"]
    assert httpx.get(f"{server}/v1/models").status_code == 401
    assert httpx.get(f"{server}/metrics").status_code == 401
    assert post(server, "/v1/completions", "{not json", key=None).status_code == 401
    wrong = openai.OpenAI(base_url=f"{server}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2}).status_code == 200
    logs = "".join(p.read_text() for p in served_model.glob("server-*.log"))
    assert API_KEY not in logs


def test_completions_equal_library_generation(client, reference):
    prompts = ["def add(a, b):", "hello world"]
    out = client.completions.create(model=MODEL, prompt=prompts, max_tokens=24, temperature=0)
    assert [c.text for c in sorted(out.choices, key=lambda c: c.index)] == reference(prompts, 24)
    assert {c.finish_reason for c in out.choices} == {"length"}
    assert out.usage.completion_tokens == 48 and out.usage.prompt_tokens > 2


def test_streaming_sends_the_same_text(client):
    whole = client.completions.create(model=MODEL, prompt="import os", max_tokens=30, temperature=0)
    chunks = list(
        client.completions.create(
            model=MODEL, prompt="import os", max_tokens=30, temperature=0, stream=True
        )
    )
    assert len(chunks) > 2  # token by token, not one block
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    with_usage = list(
        client.completions.create(
            model=MODEL,
            prompt="import os",
            max_tokens=30,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert with_usage[-1].choices == [] and with_usage[-1].usage.completion_tokens == 30
    assert "".join(c.choices[0].text for c in with_usage[:-1]) == whole.choices[0].text


def test_stop_string_cuts_streamed_and_whole(client):
    text = client.completions.create(model=MODEL, prompt="the", max_tokens=40, temperature=0)
    text = text.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]  # a string the greedy answer reaches
    expected = text[: text.find(stop)]
    cut = client.completions.create(
        model=MODEL, prompt="the", max_tokens=40, temperature=0, stop=[stop]
    )
    assert (cut.choices[0].text, cut.choices[0].finish_reason) == (expected, "stop")
    chunks = client.completions.create(
        model=MODEL, prompt="the", max_tokens=40, temperature=0, stop=stop, stream=True
    )
    assert "".join(c.choices[0].text for c in chunks) == expected


def test_seed_makes_sampling_reproducible(client):
    def sample(seed: int) -> str:
        out = client.completions.create(
            model=MODEL, prompt="hello", max_tokens=20, temperature=1.0, top_p=0.9, seed=seed
        )
        return out.choices[0].text

    assert sample(7) == sample(7)


def test_chat_uses_the_template(client, reference):
    messages = [{"role": "user", "content": "hello batch"}]
    out = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=16, temperature=0
    )
    expected = reference(["<user>hello batch\n<assistant>"], 16)[0]
    assert out.choices[0].message.content == expected
    assert out.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=16, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream) == expected
    two = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=16, temperature=0, n=2
    )
    assert [c.message.content for c in two.choices] == [expected, expected]
    assert [c.index for c in two.choices] == [0, 1] and two.usage.completion_tokens == 32


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        ({"prompt": "hello " * 80, "max_tokens": 2}, 400, "above this server's limit of 64"),
        ({"prompt": "hi", "max_tokens": 1001}, 400, "max_tokens 1001 is above"),
        ({"prompt": "hello " * 30, "max_tokens": 1000}, 400, f"context of {CONTEXT} tokens"),
        ({"prompt": "hi", "max_token": 2}, 400, "max_token: Extra inputs are not permitted"),
        ({"prompt": "hi", "temperature": -1}, 400, "temperature: Input should be greater"),
        ({"prompt": ""}, 400, "prompt"),
        ({"prompt": "hi", "seed": 1 << 70}, 400, "seed: Input should be less than"),
        ({"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
        ({"prompt": "hi", "n": 2, "stream": True}, 400, "n > 1 is served without stream"),
        ({"max_tokens": 2}, 400, "prompt: Field required"),
        ({"prompt": "hi", "model": "gpt-4"}, 404, "'gpt-4' is not served here"),
        ({"prompt": "hi", "model": "ckpt"}, 404, f"use {RUN_NAME!r}"),  # not the folder's name
        ('{"prompt": "hi",', 400, "not valid JSON"),
        ({"prompt": "x" * 5000}, 413, "larger than the limit of 4096 bytes"),
    ],
)
def test_bad_requests_get_a_4xx_naming_the_problem(server, body, status, message):
    response = post(server, "/v1/completions", body)
    assert response.status_code == status, response.text
    assert message in response.json()["error"]["message"]


def test_limit_on_prompts_per_request(client):
    with pytest.raises(openai.BadRequestError, match="at most 3"):
        client.completions.create(model=MODEL, prompt=["a"] * 4, max_tokens=1)


def open_stream(server: str, prompt: str) -> tuple[httpx.Client, httpx.Response, Iterator[str]]:
    """A streaming request of 1000 greedy tokens, after its first chunk has arrived (with its
    line iterator, kept: dropping it would close the stream)."""
    http = httpx.Client(timeout=60, headers={"Authorization": f"Bearer {API_KEY}"})
    body = {"prompt": prompt, "max_tokens": 1000, "temperature": 0, "stream": True}
    response = http.send(
        http.build_request("POST", f"{server}/v1/completions", json=body), stream=True
    )
    assert response.status_code == 200
    lines = response.iter_lines()
    next(lines)
    return http, response, lines


def wait_for(predicate, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_busy_server_answers_429_and_a_disconnect_frees_its_slot(server, client):
    before = metrics(server)
    streams = [open_stream(server, f"hello {i}") for i in range(MAX_CONCURRENT)]
    with pytest.raises(openai.RateLimitError, match="busy") as busy:
        client.completions.create(model=MODEL, prompt="one more", max_tokens=1)
    assert busy.value.response.headers["retry-after"] == "1"
    assert metrics(server)["in_flight"] == MAX_CONCURRENT
    for http, response, _ in streams:  # the clients go away mid-stream
        response.close()
        http.close()
    wait_for(lambda: metrics(server)["in_flight"] == 0 and metrics(server)["active"] == 0)
    after = metrics(server)
    assert after["cancelled_total"] - before["cancelled_total"] == MAX_CONCURRENT
    assert after["tokens_total"] - before["tokens_total"] < MAX_CONCURRENT * 1000  # stopped early
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices[0].text


def test_a_client_that_stops_waiting_for_a_whole_answer_frees_its_slot(server):
    before = metrics(server)
    body = {"prompt": "hello", "max_tokens": 1000, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        post(server, "/v1/completions", body, timeout=0.25)  # 1000 tokens take ~1 s here
    # The slot is freed as the request leaves; the engine counts the cancel at its next step.
    wait_for(lambda: metrics(server)["cancelled_total"] == before["cancelled_total"] + 1)
    after = metrics(server)
    assert after["in_flight"] == 0
    assert after["tokens_total"] - before["tokens_total"] < 1000


def test_concurrent_requests_decode_in_one_batch(server, client, reference):
    prompts = ["def add(a, b):", "import sys", "the lazy dog"]
    before = metrics(server)
    texts: dict[int, str] = {}

    def ask(i: int) -> None:
        out = client.completions.create(
            model=MODEL, prompt=prompts[i], max_tokens=200, temperature=0
        )
        texts[i] = out.choices[0].text

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    after = metrics(server)
    assert after["batched_steps_total"] > before["batched_steps_total"]
    assert after["max_rows_in_step"] >= 2
    # Joining a running batch changes nothing in the answers.
    assert [texts[i] for i in range(len(prompts))] == reference(prompts, 200)


def test_stream_safe_length_holds_back_what_may_still_change():
    assert stream_safe_length("abc\n", ["\n\n"]) == 3  # "\n" may start the stop string
    assert stream_safe_length("abc\nd", ["\n\n"]) == 5
    assert stream_safe_length("abcST", ["STOP", "x"]) == 3


def test_chat_without_template_is_refused_and_sigterm_drains(served_model):
    with running_server(served_model) as (url, proc):
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        response = post(url, "/v1/chat/completions", body, key=None)
        assert response.status_code == 400
        assert "no chat template" in response.json()["error"]["message"]

        body = {"prompt": "hello", "max_tokens": 600, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as stream:
            lines = stream.iter_lines()
            first = next(lines)
            proc.send_signal(signal.SIGTERM)  # mid-stream
            rest = [line for line in lines if line]
        events = [json.loads(line[6:]) for line in [first, *rest][:-1] if line]
        assert rest[-1] == "data: [DONE]"
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        # Clean exit; recent uvicorn re-raises the signal it caught once it has shut down.
        assert proc.wait(60) in (0, -signal.SIGTERM)
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{url}/health", timeout=2)


MC_QUERIES = [
    "the quick brown fox jumps over the",
    "hello world, hello",
    "import os\nimport",
    "def add(a, b):\n    return a +",
    "the lazy",
    "hello server, hello",
    "import sys\n",
    "jumps over the",
]
MC_CHOICES = [" fox", " dog", " lazy", " quick", " world", " server", " batch", " return"]
LM_EVAL_TASK = """task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{query}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{gold}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
"""


def test_lm_eval_local_completions_scores_as_eval_py(server, served_model, tmp_path, monkeypatch):
    """Issue 24: lm-evaluation-harness's own client, against this server, on a local multiple
    choice task, scores what scripts/eval.py scores on the same checkpoint (both exactly 0.5:
    the gold answers are the model's own picks for half the questions, set here)."""
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)
    import lm_eval
    from lm_eval.tasks import TaskManager

    from llmfoundry.eval.icl import Task
    from llmfoundry.eval.scoring import ModelForward, score_continuations

    model, tokenizer_path = load_pretrained(str(served_model / "ckpt"))
    tokenizer = prepare_tokenizer(tokenizer_path)
    lengths = {len(tokenizer.encode(c)) for c in MC_CHOICES}
    assert lengths == {3}  # eval.py's mean loss and lm-eval's summed logprob pick alike
    examples = [
        {"query": q, "choices": MC_CHOICES[i % 5 : i % 5 + 4], "gold": 0}
        for i, q in enumerate(MC_QUERIES)
    ]
    questions = Task("tiny_mc", "multiple_choice", examples).prepare(tokenizer, CONTEXT, 0, 0, None)
    for i, (example, question) in enumerate(zip(examples, questions.questions, strict=True)):
        losses = [
            s.mean_loss for s in score_continuations(ModelForward(model), question.choices, CONTEXT)
        ]
        picked = losses.index(min(losses))
        example["gold"] = picked if i % 2 == 0 else (picked + 1) % 4
    data = tmp_path / "tiny_mc.jsonl"
    data.write_text("".join(json.dumps(e) + "\n" for e in examples))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "tiny_mc.yaml").write_text(LM_EVAL_TASK.format(data=data))
    hf_tokenizer = tmp_path / "hf_tokenizer"  # lm-eval tokenizes with transformers
    hf_tokenizer.mkdir()
    (hf_tokenizer / "tokenizer.json").write_text(tokenizer.json)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>"}
    (hf_tokenizer / "tokenizer_config.json").write_text(json.dumps(config))

    out = tmp_path / "eval.json"
    assert eval_script().main([str(served_model / "ckpt"), str(data), "--out", str(out)]) == 0
    ours = json.loads(out.read_text())["tasks"]["tiny_mc"]["accuracy"]
    model_args = {
        "model": MODEL,
        "base_url": f"{server}/v1/completions",
        "tokenizer": str(hf_tokenizer),
        "tokenizer_backend": "huggingface",
        "max_length": CONTEXT,
        "max_retries": 1,
    }
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=model_args,
        tasks=["tiny_mc"],
        task_manager=TaskManager(include_path=str(tasks)),
        num_fewshot=0,
    )
    assert ours == 0.5
    assert results["results"]["tiny_mc"]["acc,none"] == ours


def test_lm_eval_in_process_equals_the_server_and_hflm(served_model, server, tmp_path, monkeypatch):
    """Issue 35: lm-eval in process (llmfoundry/harness.py) scores the three local tasks
    (multiple choice, rolling perplexity, generate_until) as lm-eval's local-completions client
    against this server and as HFLM on the transformers export: every sample's responses and
    metric equal (log-likelihoods to 1e-5, accuracies and generated text exactly)."""
    pytest.importorskip("accelerate")  # HFLM's
    from lm_eval.api.registry import get_model
    from lm_eval.models.huggingface import HFLM

    from llmfoundry.harness import FoundryLM
    from llmfoundry.models.mpt.hf import export_to_hf
    from llmfoundry.tokenizers.tokenizer import EOS_TOKEN
    from tests.eval import lm_eval_parity as parity

    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)
    parity.skip_environment_report(monkeypatch)
    model, tokenizer_path = load_pretrained(str(served_model / "ckpt"))
    tokenizer = prepare_tokenizer(tokenizer_path)
    parity.check_prompts_fit(tokenizer.encode)
    export_to_hf(model, tmp_path / "hf", tokenizer=tokenizer.tokenizer, eos_token=EOS_TOKEN)
    tasks = parity.write_tasks(tmp_path)

    ours = parity.evaluate(
        FoundryLM(checkpoint=model, tokenizer=tokenizer, max_seq_len=parity.MAX_LEN), tasks
    )
    client = get_model("local-completions")(
        model=MODEL,
        base_url=f"{server}/v1/completions",
        tokenizer=str(tmp_path / "hf"),
        tokenizer_backend="huggingface",
        max_length=parity.api_max_length(),
        max_retries=1,
    )
    served = parity.evaluate(client, tasks)
    hf = HFLM(
        pretrained=str(tmp_path / "hf"), max_length=parity.MAX_LEN, batch_size=1, device="cpu"
    )
    transformers = parity.evaluate(hf, tasks)
    print(parity.summary({"in process": ours, "server": served, "HFLM": transformers}))
    parity.assert_same(ours, transformers)
    parity.assert_same(ours, served, greedy=False)

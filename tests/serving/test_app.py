"""The app in this process: bad prompts and chat templates are bounded before and while they
run, off the event loop, and answered with a 4xx in the API's error shape while /health and
every other request keep being served."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from llmfoundry.serving import app as app_module
from llmfoundry.serving.tokenizer import TEMPLATE_STEPS, load_served_tokenizer
from llmfoundry.utils.errors import UserError

pytest.importorskip("fastapi")

NESTED_LOOPS = "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}"
ALTERNATING = (
    "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant') }}"
    "{% endif %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
)
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


class SlowTokenizer:
    """The real tokenizer, but encoding counts its calls and waits (at most 5 s) for `release`."""

    def __init__(self, real: Any) -> None:
        self.real, self.calls, self.release = real, 0, threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def _wait(self) -> None:
        self.calls += 1
        self.release.wait(5)

    def encode(self, *args: Any, **kwargs: Any) -> Any:
        self._wait()
        return self.real.encode(*args, **kwargs)

    def encode_batch(self, *args: Any, **kwargs: Any) -> Any:
        self._wait()
        return self.real.encode_batch(*args, **kwargs)


def in_thread(call) -> tuple[threading.Thread, list]:
    """`call()` running in a thread; its result lands in the returned list."""
    result: list = []
    thread = threading.Thread(target=lambda: result.append(call()), daemon=True)
    thread.start()
    return thread, result


def wait_for(predicate, timeout: float = 5) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def assert_health_answers_quickly(client) -> None:
    thread, result = in_thread(lambda: client.get("/health"))
    thread.join(1.0)  # in a thread: a blocked event loop fails this, rather than hanging it
    assert result and result[0].status_code == 200, "/health did not answer within 1 s"


def test_text_longer_than_its_tokens_could_hold_is_refused_untokenized(in_process_app):
    spy: list[SlowTokenizer] = []
    with in_process_app(wrap_tokenizer=lambda t: spy.append(SlowTokenizer(t)) or spy[0]) as client:
        spy[0].release.set()
        limit = 32 * 64  # CHARS_PER_TOKEN x max_prompt_tokens
        response = client.post("/v1/completions", json={"prompt": "hello " * 400})
        assert response.status_code == 400
        assert f"at most {limit} characters" in response.json()["error"]["message"]
        many = {"messages": [{"role": "user", "content": "x" * 1000}] * 3}
        response = client.post("/v1/chat/completions", json=many)
        assert response.status_code == 400
        assert "the messages have 3012 characters" in response.json()["error"]["message"]
        response = client.post("/v1/completions", json={"prompt": ["hi"] * 40})
        assert response.status_code == 400
        assert "40 prompts in one request" in response.json()["error"]["message"]
        assert spy[0].calls == 0  # each refused before the tokenizer saw it
        ok = client.post("/v1/completions", json={"prompt": "hello " * 10, "max_tokens": 2})
        assert ok.status_code == 200 and spy[0].calls == 1


def test_health_answers_while_a_prompt_is_tokenized(in_process_app):
    spy: list[SlowTokenizer] = []
    with in_process_app(wrap_tokenizer=lambda t: spy.append(SlowTokenizer(t)) or spy[0]) as client:
        body = {"prompt": "hello world", "max_tokens": 2}
        thread, result = in_thread(lambda: client.post("/v1/completions", json=body))
        wait_for(lambda: spy[0].calls == 1)  # the request is tokenizing
        assert_health_answers_quickly(client)
        spy[0].release.set()
        thread.join(10)
        assert result[0].status_code == 200, result[0].text


def test_a_prompt_not_ready_in_time_is_a_503(in_process_app, monkeypatch):
    monkeypatch.setattr(app_module, "PREPARE_TIMEOUT_S", 0.2)
    spy: list[SlowTokenizer] = []
    with in_process_app(wrap_tokenizer=lambda t: spy.append(SlowTokenizer(t)) or spy[0]) as client:
        try:
            response = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        finally:
            spy[0].release.set()
        assert response.status_code == 503, response.text
        assert "took more than 0.2 s" in response.json()["error"]["message"]
        assert response.headers["retry-after"] == "1"


def test_a_template_with_nested_loops_is_a_400_and_the_server_answers_meanwhile(
    in_process_app,
):
    with in_process_app(chat_template=NESTED_LOOPS) as client:
        start = time.monotonic()
        thread, result = in_thread(lambda: client.post("/v1/chat/completions", json=CHAT))
        while thread.is_alive() and time.monotonic() - start < 10:
            assert_health_answers_quickly(client)
            thread.join(0.05)
        assert not thread.is_alive(), "the template still runs after 10 s"
        response = result[0]
        assert response.status_code == 400, response.text
        assert f"more than {TEMPLATE_STEPS} steps" in response.json()["error"]["message"]


@pytest.mark.parametrize(
    ("template", "messages", "message"),
    [
        (
            ALTERNATING,
            [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
            "refused these messages: Conversation roles must alternate",
        ),
        (
            "{{ messages.__class__.__base__.__subclasses__() }}",
            [{"role": "user", "content": "a"}],
            "the sandbox forbids: access to attribute '__class__'",
        ),
        (
            "{{ messages[0]['content'] + 1 }}",
            [{"role": "user", "content": "a"}],
            "failed on these messages (TypeError",
        ),
    ],
)
def test_template_errors_are_400s_in_the_error_shape(in_process_app, template, messages, message):
    with in_process_app(chat_template=template) as client:
        response = client.post("/v1/chat/completions", json={"messages": messages})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert message in error["message"] and error["type"] == "invalid_request_error"
        if template == ALTERNATING:  # the same template serves messages it accepts
            good = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
            body = {"messages": good, "max_tokens": 2}
            assert client.post("/v1/chat/completions", json=body).status_code == 200


def test_a_template_that_builds_too_much_is_a_400_and_the_next_request_is_served(
    in_process_app,
):
    doubling = (  # 2**26 characters for a 64-character message, 4 for the next
        "{% set ns = namespace(s='x') %}{% for i in range(messages[0].content|length // 2 - 6) %}"
        "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}"
    )
    with in_process_app(chat_template=doubling) as client:
        long = {"messages": [{"role": "user", "content": "y" * 64}], "max_tokens": 2}
        response = client.post("/v1/chat/completions", json=long)
        assert response.status_code == 400, response.text
        assert "built more than" in response.json()["error"]["message"]
        assert client.post("/v1/chat/completions", json=CHAT).status_code == 200


def test_a_template_that_does_not_parse_is_refused_at_start(served_model, tmp_path):
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}\n{{ m['content'] }")
    with pytest.raises(UserError, match=r"bad.jinja does not parse: .* \(line 2\)"):
        load_served_tokenizer(str(served_model / "tokenizer.json"), chat_template=bad)
    # A template that refuses the probe message, or loops, is not a syntax error: it starts.
    loops = tmp_path / "loops.jinja"
    loops.write_text(NESTED_LOOPS)
    assert load_served_tokenizer(str(served_model / "tokenizer.json"), chat_template=loops)


def test_a_lone_surrogate_in_a_message_is_a_400(in_process_app):
    body = '{"messages": [{"role": "user", "content": "a\\ud800b"}], "max_tokens": 2}'
    with in_process_app() as client:
        headers = {"content-type": "application/json"}
        response = client.post("/v1/chat/completions", content=body, headers=headers)
        assert response.status_code == 400, response.text
        assert "lone surrogate" in response.json()["error"]["message"]


class BrokenTokenizer(SlowTokenizer):
    def encode_batch(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a bug")


def test_a_bug_is_a_500_in_the_error_shape(in_process_app):
    with in_process_app(wrap_tokenizer=BrokenTokenizer) as client:
        response = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert response.status_code == 500
        assert response.json()["error"]["type"] == "server_error"
        assert "a bug" not in response.text  # the traceback goes to the log, not the client

"""An OpenAPI fuzz of the server (schemathesis): every operation of its own schema, positive and
negative examples, a fixed number each, sent to the app on a loopback port. No answer may be a
5xx, and every 4xx is in the API's error shape with a message.

Bounded: `EXAMPLES` per operation and mode, derandomized (the same requests every run), a tiny
model with `max_tokens` at most 4, so the whole fuzz takes well under a minute.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from collections.abc import Iterator

import pytest
import requests
import schemathesis  # the dev extras' (a missing one fails here, never skips the fuzz)
import uvicorn
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable

from tests.conftest import free_port
from tests.serving.conftest import API_KEY

pytestmark = pytest.mark.slow  # ~1k requests through the model

EXAMPLES = 60  # per operation and generation mode
MODES = (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE)


@contextlib.contextmanager
def on_loopback(app) -> Iterator[str]:
    """`app` served by uvicorn in a thread on a free loopback port; yields its URL."""
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.05)
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(30)


def problem(response: requests.Response) -> str | None:
    """What is wrong with an answer, or None: a 5xx, or a 4xx without the error shape."""
    if response.status_code >= 500:
        return f"{response.status_code}: {response.text[:200]}"
    if response.status_code >= 400:
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            return f"{response.status_code} not in the error shape: {response.text[:200]}"
        if not isinstance(message, str) or not message:
            return f"{response.status_code} without a message"
    return None


def fuzz(operation, mode, url: str, session, sent: Counter, failures: dict) -> None:
    """EXAMPLES requests of `operation` generated in `mode`; problems land in `failures`."""
    label = operation.label

    @settings(
        max_examples=EXAMPLES,
        derandomize=True,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def send(case) -> None:
        response = case.call(base_url=url, session=session, timeout=30)
        sent[label] += 1
        found = problem(response)
        if found is not None:  # one example per operation and kind of problem
            failures.setdefault((label, found[:60]), f"{found} <- {case.body!r}"[:400])

    try:
        send()
    except Unsatisfiable:  # nothing to make invalid (a GET without parameters)
        assert mode is schemathesis.GenerationMode.NEGATIVE, label


def test_fuzz_finds_no_server_error(in_process_app):
    sent: Counter[str] = Counter()
    failures: dict[tuple[str, str], str] = {}
    with in_process_app(api_key=API_KEY, max_tokens=4, max_concurrent=4) as client:
        schema = schemathesis.openapi.from_dict(client.app.openapi())
        with on_loopback(client.app) as url, requests.Session() as session:
            session.headers["Authorization"] = f"Bearer {API_KEY}"
            for result in schema.get_all_operations():
                for mode in MODES:
                    fuzz(result.ok(), mode, url, session, sent, failures)
    print(f"fuzz: {sum(sent.values())} requests {dict(sent)}; {len(failures)} distinct failures")
    assert sum(sent.values()) > 200
    assert not failures, "\n".join(f"{op}: {example}" for (op, _), example in failures.items())

"""A tiny served model: random weights, a BPE trained here, and the real server in a subprocess."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from llmfoundry.checkpoint.pretrained import save_weights
from llmfoundry.models.mpt import MPTConfig
from llmfoundry.models.mpt.model import MPTForCausalLM
from llmfoundry.tokenizers.tokenizer import prepare_tokenizer, train_bpe
from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]
CONTEXT = 1024
API_KEY = "test-key-0123456789"
RUN_NAME = "tiny-run"  # what the checkpoint records: the served model's id
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "import os\nimport sys\n",
    "the quick brown fox jumps over the lazy dog\n",
    "hello world, hello server, hello batch\n",
] * 20


@pytest.fixture(scope="session")
def served_model(tmp_path_factory) -> Path:
    """A weights-only checkpoint (of run RUN_NAME) with its tokenizer.json, and a chat template
    beside it.

    The EOS embedding row is zero, so the (tied) EOS logit is 0 while the others are spread
    around it: greedy decoding never picks EOS, and a request runs its whole max_tokens.
    """
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    tmp = tmp_path_factory.mktemp("served")
    train_bpe(TEXTS, vocab_size=300).save(str(tmp / "tokenizer.json"))
    tokenizer = prepare_tokenizer(tmp / "tokenizer.json")
    torch.manual_seed(0)
    config = MPTConfig(
        d_model=64, n_heads=2, n_layers=2, max_seq_len=CONTEXT, vocab_size=tokenizer.vocab_size
    )
    model = MPTForCausalLM(config)
    with torch.no_grad():
        model.transformer.wte.weight[tokenizer.eos_id] = 0
    save_weights(model, str(tmp / "ckpt"), tmp / "tokenizer.json", run_name=RUN_NAME)
    (tmp / "chat.jinja").write_text(CHAT_TEMPLATE)
    return tmp


@contextlib.contextmanager
def running_server(
    served: Path, *args: str, api_key: str | None = None, timeout: float = 90
) -> Iterator[tuple[str, subprocess.Popen]]:
    """scripts/serve.py on a free loopback port; yields its URL once /health answers."""
    import httpx

    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("LLMFOUNDRY_API_KEY", None)
    if api_key is not None:
        env["LLMFOUNDRY_API_KEY"] = api_key
    command = [sys.executable, str(ROOT / "scripts" / "serve.py"), str(served / "ckpt")]
    command += ["--port", str(port), "--log-level", "warning", *args]
    log = open(served / f"server-{port}.log", "w")  # closed in the finally below
    proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"server did not start: {(served / f'server-{port}.log').read_text()}")
            time.sleep(0.2)
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        log.close()


@pytest.fixture(scope="session")
def served_checkpoint(served_model):
    """The served model loaded once in this process, with its tokenizer's path."""
    from llmfoundry.checkpoint.pretrained import load_pretrained

    return load_pretrained(str(served_model / "ckpt"))


@pytest.fixture
def in_process_app(served_checkpoint):
    """A factory of the app in this process (no subprocess, no port): `with in_process_app(...)
    as client` runs its lifespan (the engine's thread) and yields a starlette TestClient."""
    from starlette.testclient import TestClient

    from llmfoundry.serving.app import Limits, create_app
    from llmfoundry.serving.engine import Engine
    from llmfoundry.serving.tokenizer import ServedTokenizer

    model, tokenizer_path = served_checkpoint

    @contextlib.contextmanager
    def make(
        chat_template: str | None = CHAT_TEMPLATE,
        api_key: str | None = None,
        wrap_tokenizer: Callable[[Any], Any] | None = None,
        **limits: int,
    ) -> Iterator[TestClient]:
        """`wrap_tokenizer` replaces the Rust tokenizer by what it returns (a spy, say)."""
        prepared = prepare_tokenizer(tokenizer_path)
        if wrap_tokenizer is not None:
            prepared = dataclasses.replace(prepared, tokenizer=wrap_tokenizer(prepared.tokenizer))
        tokenizer = ServedTokenizer(prepared, chat_template)
        limits = Limits(**{"max_prompt_tokens": 64, "max_tokens": 64, **limits})
        engine = Engine(model, tokenizer.decode, max_rows=limits.max_concurrent, max_len=CONTEXT)
        app = create_app(engine, tokenizer, "ckpt", limits, CONTEXT, api_key)
        with TestClient(app, raise_server_exceptions=False) as client:
            yield client

    return make

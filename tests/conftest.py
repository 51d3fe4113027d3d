"""Shared test services: a real S3 API (moto_server) on 127.0.0.1, started once per session, and
process-wide settings (logging handlers, storage options, Ctrl-C) as every test expects them."""

from __future__ import annotations

import logging
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmfoundry.utils import storage


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests marked `cuda` are skipped without a CUDA GPU (`pytest -m cuda` selects them all)."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("cuda"):
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="session")
def _ctrl_c_as_in_a_terminal() -> Iterator[None]:
    """The signal tests send SIGINT as Ctrl-C would; a shell starts background jobs (and so this
    run, when it is one) with SIGINT ignored, which every process started from here would
    inherit. Python's own handler here gives them the default disposition again."""
    previous = signal.getsignal(signal.SIGINT)
    if previous is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    if previous is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.fixture(autouse=True)
def _restore_process_settings() -> Iterator[None]:
    """Undo what configure_logging / storage.configure did (scripts' main() run in-process)."""
    root = logging.getLogger()
    handlers, levels = (
        list(root.handlers),
        {n: logging.getLogger(n).level for n in ("", "llmfoundry", "__main__")},
    )
    yield
    for handler in [h for h in root.handlers if h not in handlers]:
        root.removeHandler(handler)
        handler.close()
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)
    storage.configure()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _moto_server() -> str:
    exe = Path(sys.executable).with_name("moto_server")
    if exe.exists():
        return str(exe)
    found = shutil.which("moto_server")
    if found is None:
        pytest.skip("moto_server not installed (pip install 'moto[server]')")
    return found


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """URL of a moto S3 server, answering HTTP before the first test uses it."""
    pytest.importorskip("s3fs")
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [_moto_server(), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(url, timeout=1).close()
                break
            except urllib.error.HTTPError:
                break  # an HTTP answer of any status: the server is up
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"moto_server did not start on {url}")
                time.sleep(0.1)
        yield url
    finally:
        server.terminate()
        server.wait(10)


@pytest.fixture
def s3_env(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """Credentials and endpoint in the environment, as for MinIO or R2 in production."""
    for key, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": s3_endpoint,
    }.items():
        monkeypatch.setenv(key, value)
    return s3_endpoint

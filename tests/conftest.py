"""Shared test services: a real S3 API (moto_server) on 127.0.0.1, started once per session, and
process-wide settings (logging handlers, storage options, Ctrl-C) as every test expects them."""

from __future__ import annotations

import logging
import os
import random
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

# One OpenMP thread per test process (and per process a test starts, which inherit it), unless
# the environment says otherwise: `make test` runs two test processes beside the floor's on two
# cores, and torch's default of a thread per core then has threads spin-waiting for each other
# at every op of the tiny models tests use (a test of KV-cache generation: 130 s with two
# threads, 9 s with one, on a busy machine). Set here, before anything imports torch.
os.environ.setdefault("OMP_NUM_THREADS", "1")


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


def free_port() -> int:
    """A free TCP port on 127.0.0.1 for a server or a process group a test starts.

    Chosen below the kernel's ephemeral range (where source ports of outgoing connections come
    from): a port the OS hands out for a bind to port 0 is free only until some connection takes
    it as its source port, which happened under `make test`'s concurrent runs (EADDRINUSE when a
    process group's store bound it). Each pytest process that `make test` runs at once (the
    two xdist workers, the floor's run beside them) draws from its own slice of that range
    (`_port_slice`), so one test's process group never finds another's store on its port (a
    rank that joins the wrong group waits until its run's deadline). Drawn from the OS's
    randomness, not the `random` module that tests seed; bound once to check that it is free
    now; never one this process handed out before: a spawn draws a port per case before any
    binds, and two cases on one port could meet the earlier group's store."""
    low, high = _port_slice(20000, _ephemeral_start())
    draw = random.SystemRandom()
    for _ in range(100):
        port = draw.randrange(low, high) if high - low >= 1000 else 0
        if port in _HANDED_OUT:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            port = sock.getsockname()[1]
        _HANDED_OUT.add(port)
        return port
    raise RuntimeError("no free TCP port on 127.0.0.1 after 100 tries")


_HANDED_OUT: set[int] = set()  # free_port's answers in this process


def _port_slice(low: int, high: int) -> tuple[int, int]:
    """This pytest process's part of ports [low, high): the first third for a process that is
    no xdist worker (the floor's run beside the suite, a plain pytest), the rest split among
    the xdist workers (gwN the N-th part)."""
    own = low + (high - low) // 3
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw"):
        return low, own
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    size = (high - own) // workers
    index = int(worker[2:])
    return own + index * size, own + (index + 1) * size


def _ephemeral_start() -> int:
    """The first port of the kernel's ephemeral range (Linux: 32768 unless configured)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


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
    port = free_port()
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

"""Serving throughput and latency: scripts/serve.py under 1, 4 and 16 concurrent clients.

The model is mpt-tiny's shape (d_model 256, 4 layers, 4 heads, ALiBi) with random weights and a
BPE trained on this repository's Python files; it is saved as a checkpoint and served by the
real server (a subprocess on a loopback port, torch on one thread). Each client sends
`--requests` completions one after another (greedy, `--max-tokens` new tokens, prompts of a few
dozen tokens); a level's requests/s and tokens/s are its completed requests and generated
tokens over its wall time, and p50/p99 are the requests' latencies. A last row serves 16 clients
with `--max-batch-rows 1` (one request decoded at a time): what continuous batching saves.
Wall-clock numbers: on a shared machine, other jobs slow them.

    python bench/serving.py                        # 1, 4, 16 clients; 64 new tokens
    python bench/serving.py --clients 1 8 --max-tokens 32
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import torch

from llmfoundry.checkpoint.pretrained import save_weights
from llmfoundry.models.mpt import MPTConfig, MPTForCausalLM
from llmfoundry.tokenizers.tokenizer import prepare_tokenizer, train_bpe

ROOT = Path(__file__).resolve().parents[1]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--requests", type=int, default=4, help="requests per client (default 4)")
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens per request")
    p.add_argument("--no-baseline", action="store_true", help="skip the unbatched row")
    return p.parse_args()


def tiny_checkpoint(folder: Path) -> list[str]:
    """Save the benchmark model; return prompts (lines of this repository's code)."""
    lines = [
        line.strip()
        for path in sorted((ROOT / "llmfoundry").rglob("*.py"))
        for line in path.read_text().splitlines()
        if len(line.strip()) > 40
    ]
    train_bpe(lines, vocab_size=2048).save(str(folder / "tokenizer.json"))
    tokenizer = prepare_tokenizer(folder / "tokenizer.json")
    torch.manual_seed(0)
    config = MPTConfig(
        d_model=256, n_heads=4, n_layers=4, max_seq_len=512, vocab_size=tokenizer.vocab_size
    )
    save_weights(MPTForCausalLM(config), str(folder / "ckpt"), folder / "tokenizer.json")
    return lines[::97][:64]


@contextlib.contextmanager
def server(folder: Path, *args: str) -> Iterator[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("LLMFOUNDRY_API_KEY", None)
    command = [sys.executable, str(ROOT / "scripts" / "serve.py"), str(folder / "ckpt")]
    command += ["--port", str(port), "--log-level", "warning", "--max-concurrent", "16", *args]
    proc = subprocess.Popen(command, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                httpx.get(f"{url}/health", timeout=2).raise_for_status()
                break
            except httpx.HTTPError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the server did not start") from None
                time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(60)


def load(url: str, prompts: list[str], clients: int, requests: int, max_tokens: int) -> dict:
    """`clients` threads each sending `requests` completions; throughput and latencies."""
    latencies: list[float] = []
    tokens = [0]
    lock = threading.Lock()

    def client(c: int) -> None:
        with httpx.Client(timeout=600) as http:
            for r in range(requests):
                body = {
                    "prompt": prompts[(c * requests + r) % len(prompts)],
                    "max_tokens": max_tokens,
                    "temperature": 0,
                }
                start = time.perf_counter()
                response = http.post(f"{url}/v1/completions", json=body)
                response.raise_for_status()
                elapsed = time.perf_counter() - start
                with lock:
                    latencies.append(elapsed)
                    tokens[0] += response.json()["usage"]["completion_tokens"]

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    latencies.sort()
    return {
        "requests/s": len(latencies) / wall,
        "tokens/s": tokens[0] / wall,
        "p50 s": statistics.median(latencies),
        "p99 s": latencies[min(len(latencies) - 1, round(0.99 * (len(latencies) - 1)))],
    }


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        prompts = tiny_checkpoint(Path(tmp))
        rows: list[tuple[str, dict]] = []
        with server(Path(tmp)) as url:
            load(url, prompts, 1, 1, 8)  # warm up
            for clients in args.clients:
                rows.append(
                    (f"{clients}", load(url, prompts, clients, args.requests, args.max_tokens))
                )
        if not args.no_baseline:
            with server(Path(tmp), "--max-batch-rows", "1") as url:
                load(url, prompts, 1, 1, 8)
                result = load(url, prompts, 16, args.requests, args.max_tokens)
                rows.append(("16, unbatched", result))
    print(f"{args.requests} requests per client, {args.max_tokens} new tokens each, greedy")
    print("| clients | requests/s | tokens/s | p50 latency (s) | p99 latency (s) |")
    print("|---|---|---|---|---|")
    for name, r in rows:
        print(
            f"| {name} | {r['requests/s']:.2f} | {r['tokens/s']:.1f} | {r['p50 s']:.2f} | "
            f"{r['p99 s']:.2f} |"
        )


if __name__ == "__main__":
    main()

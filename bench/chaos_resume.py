"""Chaos resume: a pipeline-parallel run killed with SIGKILL N times ends as an uninterrupted one.

A 4-process ``scripts/train.py`` run under torchrun (``strategy=fsdp parallelism.pp=2``, gloo on
CPU, a tiny MPT) saves a checkpoint after every batch to a local moto S3 server
(``moto_server``, 127.0.0.1). Each launch is killed: once it has logged 1 to 3 batches, after a
random further delay of up to 1.5 batch times (so the kill lands during a step, a save, or the
pruning of an old checkpoint), one random worker gets SIGKILL; torchrun stops the others.
The same command is then launched again with ``autoresume=true``, until `--kills` kills; the
last launch runs to the end. An uninterrupted run of the same command is the reference:

- every logged step (``loss/train``, ``grad/norm``, from each launch's metrics.jsonl, repeated
  steps included) equals the reference's bit for bit;
- the final checkpoints have the same name and every tensor of their shards (weights and
  optimizer state) is bitwise equal.

Exit 0 only if both hold, every kill was followed by a resume, and no launch hung.

    nice python bench/chaos_resume.py                    # 20 kills, parallelism.pp=2
    nice python bench/chaos_resume.py --tp 2 --kills 5   # tp=2 x pp=2
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import psutil
import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from llmfoundry.checkpoint import read_latest
from llmfoundry.checkpoint.dcp_reader import load_shards_state, shard_reader
from llmfoundry.data.mds import MDSWriter

ROOT = Path(__file__).resolve().parents[1]
BUCKET = "chaos"
WORLD = 4
SEQ_LEN, VOCAB = 16, 64
COMPARED = ("loss/train", "grad/norm")  # what every logged step must repeat exactly
BATCH_LINE = re.compile(r"^\[batch (\d+)\]")
SAVED_LINE = re.compile(r"^saved checkpoint .*-ba(\d+)$")
LOADED_LINE = re.compile(r"^loaded checkpoint .*\(epoch \d+, batch (\d+)\)")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--kills", type=int, default=20, help="SIGKILLs before the last launch")
    p.add_argument("--batches", type=int, default=None, help="run length (default 3*kills+10)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (pp is 2)")
    p.add_argument("--seed", type=int, default=0, help="seed of the kill moments and ranks")
    p.add_argument("--work", type=Path, default=None, help="work folder (default: a temp one)")
    p.add_argument("--timeout", type=float, default=600, help="seconds a launch may take")
    return p.parse_args()


# ------------------------------------------------------------------------------ setup
def start_moto(port: int) -> tuple[subprocess.Popen, str]:
    exe = Path(sys.executable).with_name("moto_server")
    server = subprocess.Popen(
        [str(exe if exe.exists() else "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(url, timeout=1).close()
            return server, url
        except urllib.error.HTTPError:
            return server, url  # any HTTP answer: it is up
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"moto_server did not start on {url}") from None
            time.sleep(0.1)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def write_mds(root: Path, samples: int) -> Path:
    rng = np.random.default_rng(0)
    for split, count in (("train", samples), ("val", 8)):
        with MDSWriter(root / split, {"tokens": f"ndarray:uint16:{SEQ_LEN}"}, size_limit=800) as w:
            for _ in range(count):
                w.write({"tokens": rng.integers(0, VOCAB, SEQ_LEN).astype(np.uint16)})
    return root


def command(mds: Path, endpoint: str, name: str, batches: int, tp: int) -> list[str]:
    torchrun = Path(sys.executable).with_name("torchrun")
    return [
        str(torchrun), "--standalone", f"--nproc_per_node={WORLD}", str(ROOT / "scripts/train.py"),
        f"run_name={name}", f"data.remote={mds}", "data.shuffle_block_size=8",
        "model.d_model=32", "model.n_heads=2", "model.n_layers=2",
        f"model.max_seq_len={SEQ_LEN}", f"model.vocab_size={VOCAB}", "model.resid_pdrop=0.1",
        "strategy=fsdp", "parallelism.pp=2", f"parallelism.tp={tp}", "strategy.timeout_s=60",
        "device_train_microbatch_size=2", "global_train_batch_size=8",
        f"max_duration={batches}ba", "scheduler.t_warmup=2ba",
        "eval_interval=null", "eval_first=false", "callbacks=[]",
        "loggers=[console,jsonl]", "loggers.console.log_interval=1ba",
        f"save_folder=s3://{BUCKET}/{name}/checkpoints", "save_interval=1ba",
        f"storage.options.endpoint_url={endpoint}", "autoresume=true",
    ]  # fmt: skip


# ------------------------------------------------------------------------------ one launch
@dataclass
class Launch:
    """What one launch printed and how it ended."""

    resumed_from: int | None = None
    batches: list[int] = field(default_factory=list)  # batch lines, in order
    saved: list[int] = field(default_factory=list)
    batch_times: list[float] = field(default_factory=list)
    killed_rank: int | None = None
    killed_at_s: float | None = None
    exit_code: int | None = None
    hung: bool = False
    seconds: float = 0.0


def _read(stream, launch: Launch, log) -> None:
    for line in stream:
        log.write(line)
        line = line.rstrip("\n")
        if m := BATCH_LINE.match(line):
            launch.batches.append(int(m[1]))
            launch.batch_times.append(time.monotonic())
        elif m := SAVED_LINE.match(line):
            launch.saved.append(int(m[1]))
        elif m := LOADED_LINE.match(line):
            launch.resumed_from = int(m[1])


def run_launch(cmd: list[str], work: Path, env: dict, log_path: Path, rng: random.Random | None,
               timeout: float) -> Launch:  # fmt: skip
    """One launch of `cmd`; with `rng`, kill one random worker at a random moment."""
    launch, start = Launch(), time.monotonic()
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            cmd, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True,
        )  # fmt: skip
        reader = threading.Thread(target=_read, args=(process.stdout, launch, log), daemon=True)
        reader.start()
        if rng is not None:
            _kill_one(process, launch, rng, start, timeout)
        try:
            launch.exit_code = process.wait(timeout=max(1.0, start + timeout - time.monotonic()))
        except subprocess.TimeoutExpired:
            launch.hung = True
            os.killpg(process.pid, signal.SIGKILL)
            launch.exit_code = process.wait()
        reader.join(10)
    launch.seconds = time.monotonic() - start
    return launch


def _kill_one(process, launch: Launch, rng: random.Random, start: float, timeout: float) -> None:
    wanted = rng.randint(1, 3)  # batches of this launch before the kill's random delay
    while len(launch.batches) < wanted:
        if process.poll() is not None or time.monotonic() > start + timeout:
            return
        time.sleep(0.01)
    interval = 0.3  # a batch and its save, until two batch lines tell
    if len(launch.batch_times) >= 2:
        interval = launch.batch_times[-1] - launch.batch_times[-2]
    time.sleep(rng.uniform(0, 1.5 * interval))
    workers = {}
    for child in psutil.Process(process.pid).children(recursive=False):
        try:
            workers[int(child.environ()["RANK"])] = child
        except (psutil.Error, KeyError, ValueError):
            continue
    if process.poll() is not None or not workers:
        return
    rank = rng.choice(sorted(workers))
    try:
        workers[rank].send_signal(signal.SIGKILL)
    except psutil.NoSuchProcess:
        return
    launch.killed_rank, launch.killed_at_s = rank, time.monotonic() - start


# ------------------------------------------------------------------------------ comparison
def logged_steps(path: Path) -> list[tuple[int, str, float]]:
    """Every (step, metric, value) of `COMPARED` in a metrics.jsonl, repeats included; a
    truncated last line (a kill mid-write) is skipped."""
    steps = []
    lines = path.read_text().splitlines() if path.exists() else []
    for number, line in enumerate(lines, start=1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):
                break
            raise
        for name, value in record.get("metrics", {}).items():
            if name in COMPARED:
                steps.append((int(record["step"]), name, value))
    return steps


def shard_tensors(folder: str) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint's shards (model, optimizer), whole, read in this process."""
    reader = shard_reader(folder)
    metadata = reader.read_metadata()
    tensors = {
        key: torch.empty(item.size, dtype=item.properties.dtype)
        for key, item in metadata.state_dict_metadata.items()
        if isinstance(item, TensorStorageMetadata)
    }
    load_shards_state(tensors, folder, no_dist=True, reader=reader)
    return tensors


def compare(work: Path, reference: str, chaos: str, batches: int) -> tuple[bool, list[str]]:
    lines, ok = [], True
    expected = {
        (s, n): v for s, n, v in logged_steps(work / "outputs" / reference / "metrics.jsonl")
    }
    got = logged_steps(work / "outputs" / chaos / "metrics.jsonl")
    differing = [(s, n, v, expected.get((s, n))) for s, n, v in got if expected.get((s, n)) != v]
    missing = sorted({s for s in range(1, batches + 1)} - {s for s, _, _ in got})
    ok &= not differing and not missing and len(expected) == batches * len(COMPARED)
    lines.append(
        f"logged steps: {len(got)} values of {len(COMPARED)} metrics over {batches} steps "
        f"({len(got) - len(expected)} repeated after resumes); differing: {len(differing)}, "
        f"steps missing: {missing or 'none'}"
    )
    for s, n, v, e in differing[:5]:
        lines.append(f"  step {s} {n}: {v!r} != reference {e!r}")
    names = [read_latest(f"s3://{BUCKET}/{run}/checkpoints") for run in (reference, chaos)]
    ok &= names[0] == names[1] and names[0] is not None
    lines.append(f"final checkpoints: reference {names[0]}, chaos {names[1]}")
    if names[0] == names[1] and names[0] is not None:
        a, b = (
            shard_tensors(f"s3://{BUCKET}/{run}/checkpoints/{names[0]}/sharded")
            for run in (reference, chaos)
        )
        unequal = sorted(k for k in a if k not in b or not torch.equal(a[k], b[k]))
        ok &= a.keys() == b.keys() and not unequal
        models = sum(k.startswith("model.") for k in a)
        lines.append(
            f"final shards: {len(a)} tensors ({models} weights, {len(a) - models} optimizer); "
            f"bitwise unequal: {len(unequal)} {unequal[:5] if unequal else ''}"
        )
    return ok, lines


# ------------------------------------------------------------------------------ main
def main() -> int:
    args = parse_args()
    batches = args.batches or 3 * args.kills + 10
    work = args.work or Path(tempfile.mkdtemp(prefix="chaos-resume-"))
    work.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    server, endpoint = start_moto(free_port())
    try:
        env = {
            **os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
            "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": endpoint,
        }  # fmt: skip
        os.environ.update({k: env[k] for k in env if k.startswith("AWS_")})
        import s3fs

        s3fs.S3FileSystem(endpoint_url=endpoint, skip_instance_cache=True).mkdir(BUCKET)
        mds = write_mds(work / "mds", 256)
        print(f"work folder {work}; moto S3 at {endpoint}; {batches} batches, tp={args.tp} pp=2")
        ok = run_all(args, work, env, mds, endpoint, batches)
    finally:
        server.terminate()
        server.wait(10)
    print(f"total {time.monotonic() - started:.0f} s; result: {'EQUAL' if ok else 'DIFFERENT'}")
    return 0 if ok else 1


def run_all(args, work: Path, env: dict, mds: Path, endpoint: str, batches: int) -> bool:
    def cmd(name: str) -> list[str]:
        return command(mds, endpoint, name, batches, args.tp)

    reference = run_launch(cmd("reference"), work, env, work / "reference.log", None, args.timeout)
    print(f"reference: exit {reference.exit_code}, {reference.seconds:.0f} s")
    if reference.exit_code != 0:
        print(f"the reference run failed: see {work / 'reference.log'}")
        return False
    rng, launches = random.Random(args.seed), []
    print("| launch | resumed from | killed rank | at (s) | last batch seen | exit | s |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    while True:
        kill = rng if sum(la.killed_rank is not None for la in launches) < args.kills else None
        number = len(launches) + 1
        launch = run_launch(
            cmd("chaos"), work, env, work / f"chaos-{number}.log", kill, args.timeout
        )
        launches.append(launch)
        print(
            f"| {number} | {launch.resumed_from} | {launch.killed_rank} | "
            f"{launch.killed_at_s or 0:.1f} | {(launch.batches or [None])[-1]} | "
            f"{launch.exit_code}{' HUNG' if launch.hung else ''} | "
            f"{launch.seconds:.0f} |",
            flush=True,
        )
        if launch.hung or (launch.killed_rank is None and launch.exit_code != 0):
            print(f"launch {number} failed: see {work / f'chaos-{number}.log'}")
            return False
        if launch.killed_rank is None:
            break
    kills = sum(la.killed_rank is not None for la in launches)
    resumes = sum(la.resumed_from is not None for la in launches)
    # Every launch after one that logged a saved checkpoint must resume from one.
    due = sum(any(earlier.saved for earlier in launches[:i]) for i in range(1, len(launches)))
    # Kills before the checkpoint of the launch's last logged batch counted (during its save,
    # or between the step and the save): the next launch resumed from an earlier one.
    in_save = sum(
        bool(la.batches) and (after.resumed_from or 0) < la.batches[-1]
        for la, after in itertools.pairwise(launches)
    )
    print(
        f"kills: {kills} ({in_save} before the checkpoint of the last logged batch counted), "
        f"resumes from a checkpoint: {resumes} (due at least: {due}), launches: {len(launches)}"
    )
    ok, lines = compare(work, "reference", "chaos", batches)
    print("\n".join(lines))
    if kills < args.kills:
        print(f"only {kills} of {args.kills} kills: the run ended first; raise --batches")
        ok = False
    return ok and resumes >= due


if __name__ == "__main__":
    sys.exit(main())

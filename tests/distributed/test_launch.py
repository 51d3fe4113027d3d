"""`scripts/train.py` under torchrun: two "nodes" on loopback through the c10d rendezvous, and a
rank that raises mid-step bringing the whole job down promptly (FSDP, and a pipeline)."""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from tokenizers import Tokenizer, models, pre_tokenizers

from llmfoundry.checkpoint import read_latest
from llmfoundry.trainer import Callback
from tests.checkpoint.helpers import sample_ids, write_mds

from .test_fsdp import free_port

ROOT = Path(__file__).resolve().parents[2]
LIMIT_S = 150


class RaiseOnRank(Callback):
    """Raises on one rank at the end of a batch (writing the time to `stamp` first); the other
    goes on into the next step's collectives."""

    def __init__(self, rank: int, batch: int, stamp: str) -> None:
        self.rank, self.batch, self.stamp = rank, batch, stamp

    def batch_end(self, state, logger) -> None:
        if state.rank == self.rank and state.timestamp.batch == self.batch:
            Path(self.stamp).write_text(repr(time.time()))
            raise RuntimeError(f"injected failure on rank {self.rank}")


class SamplesRead(Callback):
    """Writes `folder`/rank<R>.json at the end: this rank's context-parallel degree and
    data-parallel rank, and the ids of the samples it read in each batch."""

    def __init__(self, folder: str) -> None:
        self.folder, self.ids = folder, []

    def after_dataloader(self, state, logger) -> None:
        self.ids.append(sample_ids(state.batch))

    def fit_end(self, state, logger) -> None:
        strategy = state.strategy
        read = {"cp": strategy.cp, "dp_rank": strategy.dp_rank, "ids": self.ids}
        (Path(self.folder) / f"rank{state.rank}.json").write_text(json.dumps(read))


@pytest.fixture(scope="module")
def mds(tmp_path_factory):
    return write_mds(tmp_path_factory.mktemp("mds"), {"train": 32, "val": 8})


TORCHRUN = (sys.executable, "-m", "torch.distributed.run")
OUR_TORCHRUN = (sys.executable, str(ROOT / "scripts" / "torchrun.py"))  # the README's


def train_command(mds, tmp_path, *torchrun_args, overrides=(), launcher=TORCHRUN):
    return [
        *launcher, *torchrun_args, "--max-restarts=0",
        str(ROOT / "scripts" / "train.py"),
        f"data.remote={mds}", "data.shuffle_block_size=8",
        "model.d_model=32", "model.n_heads=2", "model.n_layers=2", "model.max_seq_len=16",
        "model.vocab_size=64", "global_train_batch_size=4", "max_duration=3ba",
        "scheduler.t_warmup=1ba", "eval_interval=3ba", "eval_first=false",
        "eval_subset_num_batches=1", "callbacks=[]", "loggers=[console]",
        "strategy=fsdp", "strategy.device=cpu", f"save_folder={tmp_path / 'ckpt'}",
        *overrides,
    ]  # fmt: skip


def launch(command, cwd):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def test_two_nodes_on_loopback_share_one_run_folder_and_rank_0_logs(mds, tmp_path):
    """Each node's process holds half of every sequence (parallelism.cp=2: one data-parallel
    rank, so both read the same samples), through training, evaluation and a DCP save."""
    endpoint = f"127.0.0.1:{free_port()}"
    torchrun = ("--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d",
                f"--rdzv_endpoint={endpoint}", "--rdzv_id=loopback")  # fmt: skip
    read = (
        "parallelism.cp=2",
        "+callbacks.read._target_=tests.distributed.test_launch.SamplesRead",
        f"+callbacks.read.folder={tmp_path}",
    )
    command = train_command(mds, tmp_path, *torchrun, overrides=read)
    nodes = [launch(command, tmp_path) for _ in range(2)]
    outputs = []
    for node in nodes:
        try:
            outputs.append(node.communicate(timeout=LIMIT_S)[0])
        except subprocess.TimeoutExpired:
            for other in nodes:
                other.kill()
            pytest.fail(f"two-node run did not finish within {LIMIT_S} s")
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(outputs)
    # Rank 0 (on whichever node the rendezvous made first) logs; the other node stays quiet.
    logging = ["loss/train" in out for out in outputs]
    assert sorted(logging) == [False, True], "\n".join(outputs)
    assert [p.name for p in (tmp_path / "outputs").iterdir()] == ["run-loopback"]
    assert read_latest(str(tmp_path / "ckpt")) == "ep0-ba3"
    assert (tmp_path / "ckpt" / "ep0-ba3" / "sharded" / ".metadata").exists()
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [(r["cp"], r["dp_rank"]) for r in ranks] == [(2, 0), (2, 0)]
    assert ranks[0]["ids"] == ranks[1]["ids"] and len(ranks[0]["ids"]) == 3
    assert all(len(batch) == 4 for batch in ranks[0]["ids"])  # the whole global batch each


# FSDP alone, and two pipeline stages (the surviving stage waits in a point-to-point receive),
# the latter by the strategy group's old key: an alias of parallelism.pp, noticed once.
@pytest.mark.parametrize(
    "mesh",
    [(), ("strategy.pp=2", "device_train_microbatch_size=1")],
    ids=["fsdp", "pp2"],
)
def test_a_rank_that_raises_mid_run_ends_the_job_promptly(mds, tmp_path, mesh):
    crash = (
        *mesh,
        "+callbacks.crash._target_=tests.distributed.test_launch.RaiseOnRank",
        "+callbacks.crash.rank=1",
        "+callbacks.crash.batch=1",
        f"+callbacks.crash.stamp={tmp_path / 'raised'}",
    )
    command = train_command(mds, tmp_path, "--standalone", "--nproc_per_node=2", overrides=crash)
    job = launch(command, tmp_path)
    try:
        out = job.communicate(timeout=LIMIT_S)[0]
    except subprocess.TimeoutExpired:
        job.kill()
        pytest.fail(f"the job outlived its failed rank by {LIMIT_S} s")
    ended = time.time()
    assert job.returncode != 0
    assert "injected failure on rank 1" in out
    assert out.count("strategy.pp=2 is parallelism.pp=2 now; use the new key") == len(mesh) // 2
    # Far below the collective timeout (strategy.timeout_s, 1800 s): the surviving rank fails
    # as soon as its peer's connection is gone, and torchrun ends the job.
    took = ended - float((tmp_path / "raised").read_text())
    assert took < 20, f"the job ended {took:.1f} s after the failure\n{out}"


@pytest.fixture(scope="module")
def mds_with_tokenizer(mds):
    """`mds` with a tokenizer.json beside it, as data_prep writes: the default config's
    `generate` callback reads it."""
    vocab = {f"w{i}": i for i in range(64)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(mds / "tokenizer.json"))
    return mds


@pytest.fixture(scope="module")
def icl_task(tmp_path_factory):
    """A multiple-choice task in `mds_with_tokenizer`'s words."""
    path = tmp_path_factory.mktemp("icl") / "mc.jsonl"
    lines = [
        {"query": f"w{i} w{i + 1}", "choices": [f" w{i + 2}", " w9"], "gold": i % 2}
        for i in range(4)
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


# The default config's callbacks on a mesh, as one process runs them: the samples (8 tokens:
# each is a forward through the mesh) are logged once, and under pp=2 icl_eval's accuracy too
# (under tp=2 its forward is test_mesh_eval's; the callback is the same). pp=2 on 4 processes, as
# the issue ran it: two data-parallel pipelines, whose per-device batch of 2 was one
# microbatch, refused for pp=2 (the default microbatch size now makes what 1F1B needs).
@pytest.mark.parametrize(
    ("mesh", "processes", "icl"),
    [("parallelism.tp=2", 2, False), ("parallelism.pp=2", 4, True)],
    ids=["tp2", "pp2"],
)
def test_the_default_config_trains_samples_and_scores_on_a_mesh(
    mds_with_tokenizer, icl_task, tmp_path, mesh, processes, icl
):
    defaults = yaml.safe_load((ROOT / "conf" / "train.yaml").read_text())["defaults"]
    callbacks = next(d["callbacks"] for d in defaults if isinstance(d, dict) and "callbacks" in d)
    scoring = [
        f"callbacks=[{','.join(callbacks)},icl_eval]",
        f"callbacks.icl_eval.tasks=[{icl_task}]",
    ]
    command = train_command(
        mds_with_tokenizer, tmp_path, "--standalone", f"--nproc_per_node={processes}",
        overrides=[mesh, "callbacks.generate.max_new_tokens=8", *(scoring if icl else [])],
    )  # fmt: skip
    command.remove("callbacks=[]")  # the default config's
    job = launch(command, tmp_path)
    out = job.communicate(timeout=LIMIT_S)[0]
    assert job.returncode == 0, out
    assert "loss/train" in out
    assert out.count("--- sample (prompt ") == 1, out
    scored = re.findall(r"^mc \(multiple_choice, 0-shot\): \d/4$", out, re.MULTILINE)
    assert len(scored) == icl, out
    assert "suboptimal" not in out  # DTensor's warning on every tp rank (the gradient norm)


def test_a_user_error_under_torchrun_is_printed_once(mds, tmp_path):
    """Every rank fails the same way on a bad config; rank 0 alone says so, and scripts/
    torchrun.py adds nothing to that line (plain torchrun adds its ~25-line report)."""
    command = train_command(
        mds, tmp_path, "--standalone", "--nproc_per_node=2",
        overrides=["global_train_batch_size=3"], launcher=OUR_TORCHRUN,
    )  # fmt: skip
    job = launch(command, tmp_path)
    out = job.communicate(timeout=LIMIT_S)[0]
    assert job.returncode == 2, out
    lines = [line for line in out.splitlines() if not line.startswith("precision=auto")]
    assert lines == [
        "error: global_train_batch_size=3 is not divisible by the 2 data-parallel ranks; use 2 or 4"
    ], out


def test_any_other_failure_keeps_torchruns_report(tmp_path):
    """A worker that fails otherwise (exit 1 here; a crash, a signal) is torchrun's to report:
    its agent's line, the ChildFailedError box, its exit status."""
    worker = tmp_path / "worker.py"
    worker.write_text("import os, sys\nsys.exit(1 if os.environ['RANK'] == '1' else 2)\n")
    job = launch([*OUR_TORCHRUN, "--standalone", "--nproc_per_node=2", str(worker)], tmp_path)
    out = job.communicate(timeout=LIMIT_S)[0]
    assert job.returncode == 1, out
    assert "ChildFailedError" in out and "worker.py FAILED" in out
    assert "failed (exitcode: " in out  # the agent's line, held back until the outcome was known

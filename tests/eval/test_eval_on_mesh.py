"""scripts/eval.py under torchrun on a sharded checkpoint, without merging it: the model split as
training splits it (tensor, pipeline or context parallel, FSDP over the rest), each rank
reading only its part of the shards, and the same results as one process, example by example.

The ranks are two processes spawned once with the environment torchrun gives each of its
processes (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), running the script's `main`
at each mesh in a row: a torchrun launch per mesh would start the processes again, most of the
time such a run takes here. How torchrun reports a user error (exit 2) is
tests/distributed/test_launch.py's; the refusals here come before any process group.

The checkpoint is tests/checkpoint/old_main/mpt-fsdp's: a two-rank FSDP run's DCP shards (MPT,
2 blocks, 2 heads, 64 tokens), so each mesh here reshards it. Its language-modelling task is
half the model's own greedy continuations, so a weight that loaded wrong changes its scores.
"""

from __future__ import annotations

import json
import re
import runpy
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers

from llmfoundry.checkpoint.pretrained import load_pretrained
from tests.conftest import free_port
from tests.distributed.eval_script_worker import output, rank_main
from tests.distributed.spawn import run_ranks

ROOT = Path(__file__).resolve().parents[2]
SHARDED = ROOT / "tests" / "checkpoint" / "old_main" / "mpt-fsdp" / "ckpt"
WHOLE = ROOT / "tests" / "checkpoint" / "old_main" / "mpt" / "ckpt"
LIMIT_S = 180
# The spawn's runs, two processes each: the checkpoint and the mesh.
RUNS = {
    "tp2": (SHARDED, ("--tp", "2")),
    "pp2": (SHARDED, ("--pp", "2")),
    "cp2": (SHARDED, ("--cp", "2")),
    "pp2_whole": (WHOLE, ("--pp", "2")),
}
READ = re.compile(r"each rank read at most ([\d.]+)% of the \d+ bytes of weights")


def eval_main(*args: str) -> int:
    return runpy.run_path(str(ROOT / "scripts" / "eval.py"), run_name="eval")["main"](list(args))


def words(ids: list[int]) -> str:
    return "".join(f" w{i}" for i in ids)


def greedy(model: torch.nn.Module, ids: list[int], n: int) -> list[int]:
    """The model's `n` most likely next tokens after `ids`, one at a time."""
    ids = list(ids)
    for _ in range(n):
        with torch.no_grad():
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[-n:]


@pytest.fixture(scope="module")
def tasks(tmp_path_factory) -> tuple[Path, list[str]]:
    """A word-level tokenizer of the checkpoint's 64 tokens and two tasks whose odd examples
    the model gets right (their answer is its own greedy choice) and whose even ones are drawn
    at random: multiple choice between single tokens, language modelling of two tokens."""
    folder = tmp_path_factory.mktemp("tasks")
    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(64)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(folder / "tokenizer.json"))
    model, _ = load_pretrained(str(SHARDED))
    draw = torch.Generator().manual_seed(0)
    rand = lambda n: torch.randint(64, (n,), generator=draw).tolist()  # noqa: E731
    mc, lm = [], []
    for i in range(8):
        query, gold = rand(2 + i % 5), i % 3
        best = greedy(model, query, 1)[0] if i % 2 else None
        choices = [t for t in torch.randperm(64, generator=draw).tolist() if t != best][:3]
        if best is not None:
            choices[gold] = best
        mc.append({"query": words(query), "choices": [words([c]) for c in choices], "gold": gold})
        context = rand(3 + i % 6)
        answer = greedy(model, context, 2) if i % 2 else rand(2)
        lm.append({"context": words(context), "continuation": words(answer)})
    for name, lines in (("mc", mc), ("lm", lm)):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return folder, [str(folder / "mc.jsonl"), str(folder / "lm.jsonl")]


def arguments(tasks: tuple[Path, list[str]], checkpoint: Path, out: Path) -> list[str]:
    folder, files = tasks
    return [
        str(checkpoint),
        *files,
        "--tokenizer",
        str(folder / "tokenizer.json"),
        "--out",
        str(out),
    ]


@pytest.fixture(scope="module")
def one_process(tasks, tmp_path_factory) -> dict[Path, dict]:
    """One process's report on each checkpoint (the sharded one's shards merged in the
    process)."""
    reports = {}
    for checkpoint in (SHARDED, WHOLE):
        out = tmp_path_factory.mktemp("one") / "results.json"
        assert eval_main(*arguments(tasks, checkpoint, out)) == 0
        reports[checkpoint] = json.loads(out.read_text())
    for task in reports[SHARDED]["tasks"].values():  # right and wrong answers, so a change shows
        assert 0 < task["correct"] < task["examples"], reports[SHARDED]
    return reports


@pytest.fixture(scope="module")
def meshes(tasks, tmp_path_factory) -> Path:
    """One spawn of two processes with torchrun's environment, running scripts/eval.py for
    every run in a row (module docstring): each run's results.json and every rank's stdout."""
    out = tmp_path_factory.mktemp("meshes")
    runs = {name: [*arguments(tasks, checkpoint, out / f"{name}.json"), *flags]
            for name, (checkpoint, flags) in RUNS.items()}  # fmt: skip
    ports = [free_port() for _ in RUNS]
    assert run_ranks(rank_main, 2, ports, runs, str(out), limit_s=LIMIT_S) == [0, 0]
    return out


def said(meshes: Path, run: str) -> list[str]:
    """What each rank of `run` printed."""
    return [output(str(meshes), run, rank).read_text() for rank in (0, 1)]


@pytest.mark.parametrize("run", ["tp2", "pp2", "cp2"])
def test_eval_on_a_mesh_reads_only_its_shards_and_equals_one_process(meshes, one_process, run):
    assert json.loads((meshes / f"{run}.json").read_text()) == one_process[SHARDED]
    rank0, rank1 = said(meshes, run)
    assert "\nmean " in rank0 and not rank1, (rank0, rank1)  # rank 0 alone prints the table
    # What DCP read on the rank that read most, of all the shard files' weights.
    read = float(READ.search(rank0).group(1))
    assert read < 100, rank0


def test_a_whole_checkpoint_on_a_mesh_is_read_whole_then_split(meshes, one_process):
    """model.safetensors has no shards to read apart: each rank reads it whole and keeps its
    part (a pipeline stage: its own modules' weights), with the results of one process."""
    assert json.loads((meshes / "pp2_whole.json").read_text()) == one_process[WHOLE]
    rank0, _ = said(meshes, "pp2_whole")
    assert "every rank read its weights whole, then kept its part (pp=2 x fsdp=1 x tp=1)" in rank0


TORCHRUN_ENV = dict(LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="1")


@pytest.mark.parametrize(
    ("world", "flags", "message"),
    [
        (
            None,
            ("--tp", "2"),
            "error: --tp 2 --pp 1 --cp 1 split the model over torchrun's processes: "
            "launch with `torchrun --nproc-per-node N scripts/eval.py ...`",
        ),
        (
            "3",
            ("--tp", "2"),
            "error: tp=2 x pp=1 x cp=1 = 2 does not divide the 3 processes: launch a multiple "
            "of 2 (torchrun --nproc-per-node)",
        ),
        (
            "4",
            ("--tp", "4"),
            "error: tp=4 does not divide the model's n_heads=2, kv_n_heads=2: choose a tp "
            "that divides each (or a model whose sizes it divides)",
        ),
        (
            "3",
            ("--pp", "3"),
            "error: pp=3 exceeds the model's 2 blocks (each pipeline stage "
            "holds at least one); use at most pp=2",
        ),
    ],
    ids=["no_torchrun", "world", "heads", "blocks"],
)
def test_a_mesh_that_does_not_fit_is_one_line_before_any_rank_waits(
    tasks, tmp_path, monkeypatch, capsys, world, flags, message
):
    """Refused from the world size and the checkpoint's config alone, before the process group
    (so alike on every rank, none left waiting): rank 0 of that world here, in this process."""
    if world is not None:
        for key, value in {**TORCHRUN_ENV, "RANK": "0", "WORLD_SIZE": world}.items():
            monkeypatch.setenv(key, value)
    with pytest.raises(SystemExit) as exited:
        eval_main(*arguments(tasks, SHARDED, tmp_path / "out.json"), *flags)
    assert exited.value.code == 2
    assert capsys.readouterr().err.strip() == message
    assert not (tmp_path / "out.json").exists()

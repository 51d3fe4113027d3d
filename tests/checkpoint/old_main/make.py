"""Writes the checkpoints `tests/checkpoint/test_old_checkpoints.py` resumes: run it once, at the
commit whose checkpoints must keep loading, from a checkout of that commit:

    git worktree add /tmp/old <commit> && cp make.py /tmp/old/ && cd /tmp/old
    PYTHONPATH=. OMP_NUM_THREADS=1 python make.py <this folder>

For each scenario it trains 4 batches straight with `scripts/train.py` (checkpoints every 2) and
keeps the batch-2 checkpoint, the data it read and every step's loss and sample ids (`steps.jsonl`).
The files here were written at 55b5ace, the main before issue 22's reshape moved the code.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3] if __name__ != "__main__" else Path.cwd()

# Scenario: (processes, model overrides). Tiny models, so the files stay a few hundred KB.
SCENARIOS = {
    "mpt": (1, ["model.d_model=16", "model.n_heads=2", "model.n_layers=2"]),
    "llama": (
        1,
        ["model=llama-tiny", "model.d_model=16", "model.n_heads=2", "model.n_kv_heads=1"]
        + ["model.n_layers=2", "model.ffn_hidden_size=32"],
    ),
    "mpt-fsdp": (2, ["model.d_model=16", "model.n_heads=2", "model.n_layers=2", "strategy=fsdp"]),
}


def train_command(mds: Path, work: Path, name: str, *overrides: str) -> list[str]:
    """The scenario's `scripts/train.py` command line (run in `work`, checkpoints in work/ckpt)."""
    return [
        sys.executable,
        str(ROOT / "scripts" / "train.py"),
        f"run_name={name}",
        f"data.remote={mds}",
        "data.shuffle_block_size=8",
        *SCENARIOS[name][1],
        "model.max_seq_len=16",
        "model.vocab_size=64",
        "global_train_batch_size=4",
        "scheduler.t_warmup=2ba",
        "eval_interval=2ba",
        "eval_first=false",
        "eval_subset_num_batches=2",
        f"save_folder={work / 'ckpt'}",
        "save_interval=2ba",
        "callbacks=[]",
        "loggers=[console]",
        "+callbacks.steps._target_=tests.checkpoint.helpers.StepRecorder",
        f"+callbacks.steps.path={work / 'steps.jsonl'}",
        *overrides,
    ]


def main(out: Path) -> None:
    sys.path.insert(0, str(ROOT))
    from tests.checkpoint.helpers import write_mds

    mds = write_mds(out / "mds", {"train": 24, "val": 8})
    for name, (procs, _) in SCENARIOS.items():
        work = out / "work" / name
        work.mkdir(parents=True)
        command = train_command(mds, work, name, "max_duration=4ba")
        if procs > 1:
            command = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                f"--nproc_per_node={procs}",
                *command[1:],
            ]
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        subprocess.run(command, cwd=work, env=env, check=True, capture_output=True)
        kept = out / name
        shutil.copytree(work / "ckpt" / "ep0-ba2", kept / "ckpt" / "ep0-ba2")
        (kept / "ckpt" / "latest").write_text("ep0-ba2\n")
        steps = [json.loads(line) for line in (work / "steps.jsonl").read_text().splitlines()]
        (kept / "steps.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    shutil.rmtree(out / "work")


if __name__ == "__main__":
    main(Path(sys.argv[1]).resolve())

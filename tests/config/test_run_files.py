"""The run folder's saved config (``.hydra/``) belongs to the run holding the folder's lock."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from llmfoundry.checkpoint.lock import FolderLock
from llmfoundry.config.run_files import CONFIG_DIR
from tests.data.test_streaming_text import token_rows, write_tokens

pytestmark = pytest.mark.slow  # runs scripts/train.py in a subprocess

ROOT = Path(__file__).resolve().parents[2]


def test_a_refused_launch_leaves_the_running_runs_files_untouched(tmp_path):
    write_tokens(tmp_path / "mds" / "train", token_rows(8))
    write_tokens(tmp_path / "mds" / "val", token_rows(4))
    run_dir = tmp_path / "run"
    saved = run_dir / CONFIG_DIR
    saved.mkdir(parents=True)
    files = {
        name: f"written by the running run: {name}\n".encode()
        for name in ("config.yaml", "hydra.yaml", "overrides.yaml")
    }
    for name, content in files.items():
        (saved / name).write_bytes(content)
    log = b"the running run's log\n"
    (run_dir / "train.log").write_bytes(log)
    lock = FolderLock(str(run_dir), "run folder").acquire()  # the running run's
    try:
        result = subprocess.run(
            [
                sys.executable,
                str(ROOT / "scripts" / "train.py"),
                f"data.remote={tmp_path / 'mds'}",
                "model.max_seq_len=32",
                "global_train_batch_size=4",
                "max_duration=1ba",
                "callbacks=[]",
                "loggers=[console]",
                f"hydra.run.dir={run_dir}",
                f"save_folder={tmp_path / 'ckpt'}",
            ],
            cwd=tmp_path,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        lock.close()
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"run folder {run_dir} is in use by another run" in result.stderr
    assert {p.name: p.read_bytes() for p in saved.iterdir()} == files
    assert (run_dir / "train.log").read_bytes() == log
    assert run_dir.is_dir()  # the running run's folder is never removed

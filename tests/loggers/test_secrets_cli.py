"""Credentials given on the command line reach no file of the run folder (the saved Hydra
config, metrics.jsonl, TensorBoard events, train.log), and the saved config is owner-only."""

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from llmfoundry.data.prep import train_bpe

from ..checkpoint.helpers import write_mds

pytestmark = pytest.mark.slow  # runs scripts in subprocesses; `make test-fast` skips it

ROOT = Path(__file__).resolve().parents[2]
SECRETS = ("hunter2", "hunter3", "hunter4")


def test_command_line_secrets_are_redacted_in_every_run_file(tmp_path):
    pytest.importorskip("tensorboard")
    data = write_mds(tmp_path / "mds", {"train": 16, "val": 8})
    train_bpe(["def f(x):\n    return x\n"] * 50, vocab_size=300).save(str(data / "tokenizer.json"))
    run_dir = tmp_path / "outputs" / "secret-run"
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "train.py"),
            "run_name=secret-run",
            f"data.remote={data}",
            "+data.storage_options.secret=hunter3",
            "callbacks.generate.prompts=['https://bob:hunter2@example.com/']",
            "callbacks.generate.max_new_tokens=2",
            "+data.storage_options.client_kwargs.aws_secret_access_key=hunter4",
            "model.d_model=32",
            "model.n_heads=2",
            "model.n_layers=1",
            "model.max_seq_len=16",
            "model.vocab_size=300",
            "global_train_batch_size=4",
            "max_duration=2ba",
            "scheduler.t_warmup=1ba",
            "eval_interval=1ba",
            "eval_subset_num_batches=1",
            "save_folder=null",
            "loggers=[console,jsonl,tensorboard]",
            "loggers.tensorboard.flush_secs=1",
        ],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "--- sample (prompt 'https://<redacted>@example.com/')" in result.stdout
    files = [p for p in run_dir.rglob("*") if p.is_file()]
    names = {p.relative_to(run_dir).as_posix() for p in files}
    assert {".hydra/config.yaml", ".hydra/overrides.yaml", "metrics.jsonl", "train.log"} <= names
    assert any(n.startswith("tensorboard/events.out") for n in names), names
    for path in files:
        content = path.read_bytes()
        assert not any(s.encode() in content for s in SECRETS), path
    for name in ("config.yaml", "hydra.yaml", "overrides.yaml"):
        mode = stat.S_IMODE((run_dir / ".hydra" / name).stat().st_mode)
        assert mode == 0o600, (name, oct(mode))
    overrides = (run_dir / ".hydra" / "overrides.yaml").read_text()
    assert "+data.storage_options.secret=<redacted>" in overrides


def test_cfg_job_prints_the_config_without_credentials(tmp_path):
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "train.py"), "--cfg", "job",
         "+data.storage_options.secret=hunter3", "data.remote=s3://bob:hunter2@example.com/mds"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "remote: s3://<redacted>@example.com/mds" in result.stdout
    assert "n_layers:" in result.stdout  # the rest of the config is there
    assert not any(s in result.stdout + result.stderr for s in SECRETS)


def test_a_sweeps_multirun_yaml_keeps_no_credentials(tmp_path):
    data = write_mds(tmp_path / "mds", {"train": 16, "val": 8})
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "train.py"), "-m", f"data.remote={data}",
         "+data.storage_options.secret=hunter3", "model.d_model=32", "model.n_heads=2",
         "model.n_layers=1", "model.max_seq_len=16", "model.vocab_size=64",
         "global_train_batch_size=4", "max_duration=1ba", "scheduler.t_warmup=1ba",
         "eval_first=false", "eval_interval=1ba", "eval_subset_num_batches=1", "save_folder=null",
         "callbacks=[run_status]", "loggers=[jsonl]"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    (sweep,) = (tmp_path / "outputs").glob("sweep-*")
    multirun = sweep / "multirun.yaml"
    assert "storage_options: {}" in multirun.read_text()
    assert stat.S_IMODE(multirun.stat().st_mode) == 0o600
    for path in [p for p in sweep.rglob("*") if p.is_file()]:  # status.json, metrics, .hydra
        assert b"hunter3" not in path.read_bytes(), path

"""Problems a user causes at run time: one line naming the problem and the fix, exit status 2,
no traceback unless asked for (`--debug` or LLMFOUNDRY_DEBUG=1); no empty run folder left behind.
Each case runs `scripts/train.py` as a user does."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ..checkpoint.helpers import write_mds

pytestmark = pytest.mark.slow  # runs scripts in subprocesses; `make test-fast` skips it

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN_ENV = {
    "RANK": "0",
    "WORLD_SIZE": "2",
    "LOCAL_RANK": "0",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29533",
}


def train(tmp_path: Path, *overrides: str, env: dict | None = None) -> subprocess.CompletedProcess:
    base = {
        k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV and k != "LLMFOUNDRY_DEBUG"
    }
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "train.py"), "run_name=failing", *overrides],
        cwd=tmp_path,
        env={**base, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
    )


def one_line_error(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


def test_missing_data_folder(tmp_path):
    line = one_line_error(train(tmp_path, f"data.remote={tmp_path / 'nowhere'}"))
    assert line.startswith(f"error: data folder {tmp_path / 'nowhere'} does not exist") and (
        "To fix" in line and "`make demo` writes the default config's data/demo/mds" in line
    )
    # The run never started: no run folder for `make plot` to pick as the latest run.
    assert not (tmp_path / "outputs" / "failing").exists()


def test_ddp_without_torchrun(tmp_path):
    line = one_line_error(train(tmp_path, "strategy=ddp"))
    assert (
        line.startswith("error: strategy=ddp needs the torchrun environment") and "torchrun" in line
    )


def test_batch_the_world_size_does_not_divide(tmp_path):
    result = train(tmp_path, "strategy=ddp", "global_train_batch_size=7", env=TORCHRUN_ENV)
    line = one_line_error(result)
    assert line.startswith("error: global_train_batch_size=7 is not divisible by the 2 ")
    assert line.endswith("use 6 or 8")  # the nearest sizes that work


def test_amp_fp16_on_cpu(tmp_path):
    line = one_line_error(train(tmp_path, "precision=amp_fp16", "strategy.device=cpu"))
    assert line.startswith("Config error: precision: amp_fp16 needs a CUDA device")


@pytest.mark.parametrize("how", ["flag", "env"])
def test_debug_shows_the_traceback(tmp_path, how):
    args = ["--debug"] if how == "flag" else []
    env = {"LLMFOUNDRY_DEBUG": "1"} if how == "env" else None
    result = train(tmp_path, "strategy=ddp", *args, env=env)
    assert result.returncode != 0
    assert "Traceback" in result.stderr and "strategy=ddp needs the torchrun" in result.stderr


def test_invalid_tokenizer_file(tmp_path):
    data = write_mds(tmp_path / "mds", {"train": 8, "val": 4})
    bad = tmp_path / "tokenizer.json"
    bad.write_text("not a tokenizer")
    line = one_line_error(
        train(tmp_path, f"data.remote={data}", f"tokenizer={bad}", "model.max_seq_len=16")
    )
    assert line.startswith(f"error: tokenizer='{bad}' is not a readable tokenizer")

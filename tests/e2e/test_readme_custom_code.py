"""The README's "Your own algorithm or callback" steps, done exactly as written: its file is
saved in the folder training is launched from, and its command runs (plus a tiny model and data)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ..checkpoint.helpers import SEQ_LEN, VOCAB, write_mds

pytestmark = pytest.mark.slow  # runs scripts in subprocesses; `make test-fast` skips it

ROOT = Path(__file__).resolve().parents[2]


def readme_section() -> str:
    text = (ROOT / "README.md").read_text()
    return text[text.index("### Your own algorithm or callback") :]


def test_readme_custom_callback_and_algorithm_run_from_the_launch_folder(tmp_path):
    section = readme_section()
    code = re.search(r"```python\n(# my_callbacks\.py\n.*?)```", section, re.S).group(1)
    command = re.search(r"```bash\n(python scripts/train\.py [^\n]+)\n```", section).group(1)
    (tmp_path / "my_callbacks.py").write_text(code)
    data = write_mds(tmp_path / "mds", {"train": 16, "val": 8})
    args = command.split()[2:]  # after `python scripts/train.py`
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "train.py"),
            *args,
            "run_name=mine",
            f"data.remote={data}",
            "model.d_model=32",
            "model.n_heads=2",
            "model.n_layers=1",
            f"model.max_seq_len={SEQ_LEN}",
            f"model.vocab_size={VOCAB}",
            "global_train_batch_size=4",
            "max_duration=4ba",
            "scheduler.t_warmup=1ba",
            "eval_interval=2ba",
            "eval_subset_num_batches=1",
            "save_folder=null",
            "callbacks=[]",
            "loggers=[jsonl]",
        ],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = (tmp_path / "outputs" / "mine" / "metrics.jsonl").read_text().splitlines()
    seen = {
        r["step"]: r["metrics"]["mine/tokens_seen"]
        for r in map(json.loads, lines)
        if "mine/tokens_seen" in r.get("metrics", {})
    }
    assert seen == {2: 2 * 4 * SEQ_LEN, 4: 4 * 4 * SEQ_LEN}  # every=2 from the README's command
    # The algorithm was applied too: the README's command switched it on by its _target_.
    config = (tmp_path / "outputs" / "mine" / ".hydra" / "config.yaml").read_text()
    assert "my_callbacks.ShiftTokens" in config

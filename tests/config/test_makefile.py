"""The Makefile's choices that no script makes: which model `make finetune-demo` starts from."""

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def pretrained(folder: Path) -> str:
    """What PRETRAINED expands to in `folder`, as finetune-demo's recipe runs it."""
    result = subprocess.run(
        [
            "make",
            "-s",
            "-f",
            str(ROOT / "Makefile"),
            "--eval",
            "show: ; @echo $(PRETRAINED)",
            "show",
        ],
        cwd=folder,
        capture_output=True,
        text=True,
        check=True,
    )
    return result.stdout.strip()


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_finetune_demo_starts_from_the_newest_demo_run_not_the_newest_run(tmp_path):
    assert pretrained(tmp_path) == ""  # no demo model: the recipe says to run make demo first
    for age, run in enumerate(["run-other-recipe", "finetune-1", "demo-2", "demo-1"]):
        folder = tmp_path / "outputs" / run / "checkpoints"
        folder.mkdir(parents=True)
        stamp = time.time() - 100 * (4 - age)  # the later in the list, the newer
        os.utime(folder, (stamp, stamp))
    assert pretrained(tmp_path) == "outputs/demo-1/checkpoints"
    # Another recipe's run after the demo (another tokenizer, maybe the same vocabulary size).
    newest = tmp_path / "outputs" / "run-2026-12-02" / "checkpoints"
    newest.mkdir(parents=True)
    assert pretrained(tmp_path) == "outputs/demo-1/checkpoints"

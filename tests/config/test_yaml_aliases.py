"""YAML alias bombs ("billion laughs") are refused before anything expands them, wherever the
project reads YAML: job files (`launch.py render`), Hydra configs (`train.py +experiment=`),
OmegaConf and plain PyYAML loads; the aliases configs really use still load."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from llmfoundry.utils.errors import UserError
from llmfoundry.utils.yaml_guard import safe_load

ROOT = Path(__file__).resolve().parents[2]
# Seconds a refused file may take in a subprocess (imports included) on a loaded machine; a file
# of 6 levels took more than 60 s to expand where nothing refused it.
TIMEOUT = 90


def bomb(levels: int, width: int = 9) -> str:
    """`levels` mappings, each a list of `width` aliases to the one before: width**levels."""
    lines = ['a0: &a0 ["lol"' + ', "lol"' * (width - 1) + "]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * width) + "]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args],
        cwd=cwd,
        env={
            **{k: v for k, v in os.environ.items() if k != "LLMFOUNDRY_DEBUG"},
            "PYTHONPATH": str(ROOT),
        },
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )


def one_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_launch_render_refuses_an_alias_bomb_at_once(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text("name: bomb\n" + bomb(6))
    line = one_line(run(str(ROOT / "scripts/launch.py"), "render", "slurm", str(job), cwd=tmp_path))
    assert line.startswith(f"Job error: {job}: its YAML aliases (*name) expand it by 672,588 nodes")
    assert "past the limit of 10,000" in line
    assert not (tmp_path / ".launch").exists()


def test_train_refuses_an_experiment_that_is_an_alias_bomb(tmp_path):
    # A copy of the project's script and conf/ (train.py reads the conf/ beside it), with the bomb
    # as conf/experiment/bomb.yaml.
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts/train.py", tmp_path / "scripts/train.py")
    shutil.copytree(ROOT / "conf", tmp_path / "conf")
    experiment = tmp_path / "conf/experiment/bomb.yaml"
    experiment.write_text("# @package _global_\n" + bomb(6))
    result = run("scripts/train.py", "+experiment=bomb", "run_name=bomb", cwd=tmp_path)
    line = one_line(result)
    assert f"{experiment}: its YAML aliases (*name) expand it by 672,588 nodes" in line, line
    assert not (tmp_path / "outputs").exists()


@pytest.mark.parametrize(
    "load",
    [
        lambda path: OmegaConf.load(path),
        lambda path: OmegaConf.create(path.read_text()),
        lambda path: safe_load(path.read_text(), str(path)),
    ],
    ids=["OmegaConf.load", "OmegaConf.create", "safe_load"],
)
def test_every_loader_refuses_a_bomb_before_expanding_it(tmp_path, load):
    path = tmp_path / "bomb.yaml"
    path.write_text(bomb(5))  # 9**5 nodes: seconds to expand (9**9 would not finish)
    with pytest.raises(UserError, match="expand it by 74,718 nodes, past the limit of 10,000"):
        load(path)


def test_a_dotlist_value_is_bounded_too():
    value = "[" + ", ".join(["&a [1, 1, 1, 1, 1, 1, 1, 1]"] + ["*a"] * 2000) + "]"
    with pytest.raises(UserError, match="YAML text: its YAML aliases"):
        OmegaConf.from_dotlist([f"x={value}"])


def test_an_alias_inside_its_own_anchor_is_refused():
    with pytest.raises(UserError, match=r"the node at line 1 holds an alias to itself"):
        safe_load("a: &a\n  - *a\n", "self.yaml")


def test_the_aliases_configs_use_still_load(tmp_path):
    shared = "base: &base {lr: 0.1, betas: [0.9, 0.95]}\nx: *base\ny: {<<: *base, lr: 0.2}\n"
    cfg = OmegaConf.create(shared)
    assert cfg.x.betas == [0.9, 0.95] and cfg.y.lr == 0.2 and cfg.y.betas[1] == 0.95
    path = tmp_path / "three.yaml"
    path.write_text(bomb(3))  # 819 nodes more than written: within the limit
    assert len(OmegaConf.load(path).a2[8]) == 9


def test_every_config_and_job_file_of_the_project_loads():
    files = sorted(ROOT.glob("conf/**/*.yaml"))
    assert len(files) > 20
    for path in files:
        OmegaConf.load(path)

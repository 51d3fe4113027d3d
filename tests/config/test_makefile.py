"""The Makefile's choices that no script makes: which model `make finetune-demo` starts from,
which torch `make test-torch-min` tests, and that `make test` runs the floor's tests beside the
suite."""

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def pretrained(folder: Path) -> str:
    """What PRETRAINED expands to in `folder`, as finetune-demo's recipe runs it."""
    return expand("PRETRAINED", folder)


def expand(variable: str, folder: Path = ROOT) -> str:
    """What the Makefile's `variable` expands to in `folder`."""
    result = subprocess.run(
        [
            "make",
            "-s",
            "-f",
            str(ROOT / "Makefile"),
            "--eval",
            f"show: ; @echo $({variable})",
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


def release(version: str) -> tuple[int, ...]:
    """A version's numbers, padded to three: 2.11 and 2.11.0 alike give (2, 11, 0)."""
    numbers = tuple(int(part) for part in version.split("."))
    return numbers + (0,) * (3 - len(numbers))


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_the_torch_floor_run_installs_the_lowest_versions_pyproject_allows():
    # A floor raised (or lowered) in one place and not the other would test another torch than
    # the one pyproject promises.
    pins = dict(pin.split("==") for pin in expand("TORCH_MIN").split())
    assert set(pins) == {"torch", "torchao"}
    pyproject = (ROOT / "pyproject.toml").read_text()
    for name, pinned in pins.items():
        floors = re.findall(rf'"{name}>=([0-9.]+)', pyproject)  # torchao: dev and fp8 extras
        assert floors, name
        assert {release(floor) for floor in floors} == {release(pinned)}, name


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_test_builds_the_floor_venv_and_runs_its_tests_beside_the_suite(tmp_path):
    """`make -n` in fresh venv folders: the floor venv is built before the suite starts (a
    prerequisite expanded before its variables were defined once left it out, and the floor's
    tests then failed to start), reads .venv's packages, and its tests run; FLOOR_TESTS= skips
    both."""

    def planned(*extra: str) -> str:
        venvs = [f"VENV={tmp_path / 'v'}", f"VENV_MIN={tmp_path / 'floor'}"]
        result = subprocess.run(
            ["make", "-n", "test", *venvs, *extra],
            cwd=ROOT, capture_output=True, text=True, check=True,
        )  # fmt: skip
        return result.stdout

    floor = str(tmp_path / "floor" / "bin" / "python")
    commands = planned()
    install = commands.index(f"{floor} -m pip install -q {expand('TORCH_MIN')}")
    suite = commands.index("-m pytest -q -n 2 --dist loadfile")
    assert install < commands.index("llmfoundry-dev.pth") < suite
    assert f'{floor} -m pytest -q -p no:cacheprovider -m "not slow" tests/distributed' in commands
    assert floor not in planned("FLOOR_TESTS=")

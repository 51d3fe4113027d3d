"""The Dockerfile Kubernetes jobs run (no Docker here: what can be checked without building)."""

import fnmatch
import re
import subprocess
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]


def _torch_requirement() -> Requirement:
    """pyproject's torch dependency (its line in [project] dependencies; tomllib is 3.11+)."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    return Requirement(re.search(r'^\s*"(torch\s*[<>=~!][^"]*)"', pyproject, re.M)[1])


def test_the_base_images_torch_is_pyprojects_floor():
    """The base's torch satisfies pyproject and is its floor (what `make test-torch-min`
    tests), and the torchao pinned beside it is the one the floor is tested with."""
    dockerfile = (ROOT / "Dockerfile").read_text()
    base = re.search(
        r"^ARG BASE=pytorch/pytorch:(\d+\.\d+\.\d+)-cuda[\d.]+-cudnn\d+-runtime$", dockerfile, re.M
    )
    assert base, "the Dockerfile's base is not a pytorch/pytorch CUDA runtime tag"
    assert re.search(r"^FROM \$\{BASE\}$", dockerfile, re.M)
    torch = base[1]
    requirement = _torch_requirement()
    assert requirement.specifier.contains(torch), (torch, str(requirement))
    floor = next(s.version for s in requirement.specifier if s.operator == ">=")
    assert torch.split(".")[:2] == floor.split(".")[:2]
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(rf"^TORCH_MIN \?= torch=={re.escape(torch)} ", makefile, re.M)
    tested_torchao = re.search(r"^TORCH_MIN \?= .*torchao==([\d.]+)", makefile, re.M)[1]
    pinned = Requirement(re.search(r'"(torchao[^"]+)"', dockerfile)[1])
    assert pinned.specifier.contains(tested_torchao), (str(pinned), tested_torchao)


def _ignored(path: str, patterns: list[str]) -> bool:
    """Whether Docker leaves `path` out of the build context: a pattern matches it or a folder
    above it (Docker's ** matches any number of folders; no '!' exceptions are used here)."""
    parts = path.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    for pattern in patterns:
        regex = fnmatch.translate(pattern).replace(".*.*/", "(.*/)?")
        if any(re.match(regex, p) for p in prefixes):
            return True
    return False


def test_dockerignore_keeps_environments_runs_data_and_secrets_out():
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    patterns = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    assert not any(p.startswith("!") for p in patterns)
    for path in (
        ".venv/bin/python",
        ".venv-torch-min/x",
        "outputs/run/checkpoints/latest",
        "data/demo/tokens.bin",
        ".launch/job/code",
        ".git/HEAD",
        ".env",
        "llmfoundry/__pycache__/x.pyc",
        "conf/certs/client.pem",
    ):
        assert _ignored(path, patterns), path
    for path in (
        "llmfoundry/__init__.py",
        "conf/train.yaml",
        "scripts/train.py",
        "pyproject.toml",
        "README.md",
        "llmfoundry/data/memmap.py",
    ):
        assert not _ignored(path, patterns), path


def test_the_readmes_build_command_is_the_makefiles():
    """README shows `make image IMAGE=...` with the docker command it runs: the same."""
    readme = (ROOT / "README.md").read_text()
    line = re.search(r"^make image (IMAGE=\S+)\s+# runs: (docker build .*)$", readme, re.M)
    assert line, "README has no `make image IMAGE=...   # runs: docker build ...` line"
    made = subprocess.run(
        ["make", "-n", "-s", "image", line[1]],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert made == line[2].strip()

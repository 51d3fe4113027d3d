"""Reading or writing a transformers folder does not import torchao (seconds, and four lines of
warnings before every such script); float8 training imports it itself (tests/models/test_float8.py)."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torchao") is None, reason="torchao is not installed"
)


def run_python(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )


def test_the_transformers_adapters_import_no_torchao():
    result = run_python(
        "import sys\n"
        "import llmfoundry.models.llama.hf, llmfoundry.models.mpt.hf\n"
        "import llmfoundry.models.hf_folder, transformers\n"
        "transformers.AutoModelForCausalLM, transformers.PreTrainedModel\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torchao'))\n"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == "[]\n"
    assert result.stderr == ""

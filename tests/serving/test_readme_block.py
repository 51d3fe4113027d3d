"""The README's serving block, run as pasted (as a bash script): the server in the background,
the wait for /health, an authorised streamed completion (the key exported for the curl too), the
manifest rendered."""

import contextlib
import os
import signal
import subprocess
import sys

import pytest

from tests.conftest import free_port
from tests.e2e.test_readme_blocks import ROOT, readme_block


@pytest.mark.slow
def test_serving_block_runs_as_pasted(served_model, tmp_path):
    """The block as a bash script in the checkout: the checkpoint, a free port and the manifest's
    path filled in, `pip install` left out (the serve extra is installed here); the completion
    must be authorised and streamed."""
    port = free_port()
    script = readme_block("pip install -e '.[serve]'").text
    script = script.replace("pip install -e '.[serve]'\n", "")
    script = script.replace("outputs/my-run/checkpoints", f"{served_model / 'ckpt'} --port {port}")
    script = script.replace("localhost:8000", f"localhost:{port}")
    script = script.replace("python scripts/", f"{sys.executable} scripts/")
    script = script.replace("> serve.yaml", f"> {tmp_path / 'serve.yaml'}")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("LLMFOUNDRY_API_KEY", None)
    shell = subprocess.Popen(
        ["bash", "-e", "-c", script], cwd=ROOT, env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
    )  # fmt: skip
    try:
        out, err = shell.communicate(timeout=180)
    finally:  # a failed line leaves the background server running: end the block's processes
        with contextlib.suppress(ProcessLookupError):
            os.killpg(shell.pid, signal.SIGKILL)
        shell.wait()
    assert shell.returncode == 0, out + err
    assert "data: " in out and '"text"' in out, out
    assert "data: [DONE]" in out
    assert "Deployment" in (tmp_path / "serve.yaml").read_text()

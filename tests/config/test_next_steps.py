"""The block a finished run prints last (config/next_steps.py): real paths, commands that parse."""

import shlex
from pathlib import Path

from llmfoundry.config.next_steps import launcher_of, next_steps


def test_demo_run_names_its_folder_and_the_commands_to_try(tmp_path):
    block = next_steps(
        tmp_path / "outputs" / "demo-1",
        "demo-1",
        "outputs/demo-1/checkpoints",
        ["run_name=demo-1", "max_duration=600ba", "callbacks.runtime_estimator.hint=a b"],
        cwd=tmp_path,
    )
    lines = block.splitlines()
    assert lines[0].startswith("run folder: outputs/demo-1 ")
    commands = [shlex.split(line, comments=True) for line in lines[2:]]
    assert commands == [
        ["python", "scripts/generate.py", "outputs/demo-1/checkpoints", "--prompt", "def "],
        ["python", "scripts/serve.py", "outputs/demo-1/checkpoints"],
        ["python", "scripts/train.py", "max_duration=600ba", "callbacks.runtime_estimator.hint=a b",
         "run_name=demo-1", "autoresume=true"],
        ["make", "finetune-demo"],
        ["python", "scripts/runs.py"],
    ]  # fmt: skip


def test_elsewhere_and_without_checkpoints(tmp_path):
    block = next_steps(Path("/elsewhere/runs/r"), "r", None, [], cwd=tmp_path)
    assert block.splitlines()[0].startswith("run folder: /elsewhere/runs/r ")
    assert "save_folder=null" in block and "generate.py" not in block and "autoresume" not in block
    assert "python scripts/runs.py /elsewhere/runs  #" in block
    block = next_steps(tmp_path / "outputs" / "r", "r", "s3://b/ck", [], cwd=tmp_path)
    assert "python scripts/serve.py s3://b/ck  #" in block


def test_a_torchrun_run_resumes_under_torchrun(tmp_path):
    """strategy=ddp refuses to start without torchrun: the resume command keeps the launcher."""
    assert launcher_of({}) == ["python"]
    launcher = launcher_of({"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"})
    assert launcher == ["python", "scripts/torchrun.py", "--nproc_per_node=2"]
    assert launcher_of({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"})[3] == "--nnodes=2"
    block = next_steps(tmp_path / "r", "r", "ck", ["strategy=ddp"], cwd=tmp_path, launcher=launcher)
    assert (
        "  python scripts/torchrun.py --nproc_per_node=2 scripts/train.py strategy=ddp run_name=r "
        "autoresume=true" in block
    )


def test_credentials_in_the_command_line_are_not_printed(tmp_path):
    overrides = ["+data.storage_options.secret=hunter3", "data.remote=s3://bob:hunter2@h/x"]
    block = next_steps(tmp_path / "r", "r", "s3://bob:hunter2@h/ck", overrides, cwd=tmp_path)
    assert "hunter" not in block and "'+data.storage_options.secret=<redacted>'" in block


def test_a_run_without_a_tokenizer_is_told_to_name_one(tmp_path):
    """Token files made elsewhere (nanoGPT's train.bin) train without a tokenizer; generate.py
    and serve.py as printed would stop at "no tokenizer found", so they name one."""
    block = next_steps(tmp_path / "r", "r", "ck", [], cwd=tmp_path, tokenizer_found=False)
    generate, serve = (shlex.split(line, comments=True) for line in block.splitlines()[2:4])
    assert generate[:5] == ["python", "scripts/generate.py", "ck", "--tokenizer", "TOKENIZER"]
    assert serve == ["python", "scripts/serve.py", "ck", "--tokenizer", "TOKENIZER"]
    assert "TOKENIZER: the one your tokens came from (tiktoken:gpt2" in block


def test_your_own_module_is_not_offered_generate_or_serve(tmp_path):
    """generate.py and serve.py refuse a model=custom checkpoint (exit 2), so a run of one does
    not print them; it still prints how to resume it."""
    block = next_steps(tmp_path / "r", "r", "ck", ["model=custom"], cwd=tmp_path, own_module=True)
    assert "python scripts/generate.py" not in block and "python scripts/serve.py" not in block
    assert "load a checkpoint's model.safetensors into your module" in block
    assert "  python scripts/train.py model=custom run_name=r autoresume=true  #" in block


def test_checkpoints_on_a_store_are_read_with_the_runs_storage_settings(tmp_path):
    """A run that saved to MinIO/moto (storage.options.endpoint_url) prints generate/serve
    commands that reach that endpoint, not AWS; unset values and secret keys are left out."""
    storage = {
        "options": {"endpoint_url": "http://localhost:9000", "profile": None, "secret": "x"},
        "overrides": {},
    }
    block = next_steps(tmp_path / "r", "r", "s3://b/ck", [], cwd=tmp_path, storage=storage)
    generate, serve = (shlex.split(line, comments=True) for line in block.splitlines()[2:4])
    flag = ["--storage", '{"options": {"endpoint_url": "http://localhost:9000"}}']
    assert generate[2:5] == ["s3://b/ck", *flag]
    assert serve == ["python", "scripts/serve.py", "s3://b/ck", *flag]
    unset = {"options": {"endpoint_url": None, "profile": None}, "overrides": {}}
    block = next_steps(tmp_path / "r", "r", "s3://b/ck", [], cwd=tmp_path, storage=unset)
    assert "python scripts/serve.py s3://b/ck  #" in block
    local = next_steps(tmp_path / "r", "r", "ck", [], cwd=tmp_path, storage=storage)
    assert "--storage" not in local

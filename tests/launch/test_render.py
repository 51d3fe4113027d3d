"""Rendered sbatch scripts and Kubernetes manifests, checked structurally."""

import importlib.util
import os
import re
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from llmfoundry.config import ConfigError
from llmfoundry.launch import load_job
from llmfoundry.launch.backends import (
    kubernetes_objects,
    render_kubernetes,
    render_slurm,
    slurm_memory,
)
from tests.k8s import validated

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "conf/job" / "tiny.yaml"
SECRET_VALUE = "s3cr3t-value-never-rendered"


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sbatch_directives(text: str) -> dict[str, str]:
    """#SBATCH lines as sbatch reads them: only before the first command, split into words at
    unquoted spaces, quotes and backslash escapes removed, an unquoted '#' starting a comment."""
    directives = {}
    for line in text.splitlines()[1:]:
        if not line.startswith("#"):
            break
        if line.startswith("#SBATCH "):
            for word in shlex.split(line.removeprefix("#SBATCH "), comments=True):
                key, _, value = word.partition("=")
                directives[key] = value
    return directives


def srun_script(text: str) -> str:
    command = text[text.index("\nsrun ") + 1 : text.index(" || rc=$?")]
    words = shlex.split(command)
    return words[words.index("-c") + 1]


def big_job(**extra):
    overrides = ["compute.gpus=24", "secrets=[WANDB_API_KEY]", "slurm.partition=h100"]
    return load_job(EXAMPLE, overrides + [f"{k}={v}" for k, v in extra.items()])


def test_slurm_script_three_nodes_of_eight(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", SECRET_VALUE)
    rendered = render_slurm(big_job(), ROOT)
    text = rendered.text
    directives = sbatch_directives(text)
    assert directives["--nodes"] == "3"
    assert directives["--ntasks-per-node"] == "1"
    assert directives["--gpus-per-node"] == "8"
    assert directives["--partition"] == "h100"
    assert "--requeue" in directives
    assert directives["--signal"] == "TERM@180"
    assert directives["--output"].endswith("outputs/mpt-tiny-demo/slurm-%j.log")
    node = srun_script(text)
    # torchrun through our launcher: a config problem is one line in the job's log
    assert "-m llmfoundry.launch.torchrun --nnodes=3 --nproc_per_node=8 --rdzv_backend=c10d" in node
    assert '--rdzv_endpoint="$LAUNCH_HEAD_NODE:29500" --rdzv_id="$SLURM_JOB_ID"' in node
    assert "run_name=mpt-tiny-demo autoresume=true" in node and "strategy=ddp" in node
    assert ': "${WANDB_API_KEY:?secret WANDB_API_KEY is not set' in node
    assert SECRET_VALUE not in text
    for script in (text, node):
        subprocess.run(["bash", "-n"], input=script, text=True, check=True, timeout=30)


def test_the_slurm_log_path_is_one_sbatch_argument_whatever_its_characters(tmp_path):
    """Unquoted, sbatch split a folder with a space into two arguments ('#' ended the line)."""
    outputs = tmp_path / "my runs #1" / '50% "final"'
    text = render_slurm(load_job(EXAMPLE, [f"outputs='{outputs}'"]), ROOT).text
    # sbatch reads %% as one % in a file name; %j is the job id.
    log = sbatch_directives(text)["--output"].replace("%%", "%")
    assert log == f"{outputs}/mpt-tiny-demo/slurm-%j.log"
    subprocess.run(["bash", "-n"], input=text, text=True, check=True, timeout=30)
    with pytest.raises(ConfigError, match=r"outputs: the Slurm log folder .* holds a backslash"):
        render_slurm(load_job(EXAMPLE, [f"outputs='{tmp_path}/a\\b'"]), ROOT)


def fake_commands(folder: Path, srun_exit: int) -> Path:
    """srun and scontrol stand-ins that record their calls (no Slurm needed)."""
    folder.mkdir()
    for name, body in {
        "srun": f'echo "srun $*" >> "$CALLS"\nexit {srun_exit}',
        "scontrol": 'if [ "$1" = show ]; then echo node-a; echo node-b; else echo "scontrol $*" >> "$CALLS"; fi',
    }.items():
        path = folder / name
        path.write_text(f"#!/bin/bash\n{body}\n")
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return folder


@pytest.mark.parametrize(
    ("srun_exit", "requeued", "exit_code"), [(75, True, 0), (0, False, 0), (3, False, 3)]
)
def test_slurm_script_requeues_an_unfinished_run(tmp_path, srun_exit, requeued, exit_code):
    script = tmp_path / "job.sbatch"
    script.write_text(render_slurm(big_job(), ROOT).text)
    bin_dir = fake_commands(tmp_path / "bin", srun_exit)
    calls = tmp_path / "calls"
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "CALLS": str(calls),
        "SLURM_JOB_ID": "42",
        "SLURM_JOB_NODELIST": "node-[a-c]",
    }
    result = subprocess.run(
        ["bash", str(script)], env=env, capture_output=True, text=True, timeout=30
    )
    assert result.returncode == exit_code, result.stderr
    log = calls.read_text()
    assert log.startswith("srun --nodes=3 --ntasks-per-node=1")
    assert ("scontrol requeue 42" in log) == requeued


def test_kubernetes_indexed_job_and_headless_service(monkeypatch):
    pytest.importorskip("kubernetes")
    monkeypatch.setenv("WANDB_API_KEY", SECRET_VALUE)
    job = big_job(outputs="s3://bucket/runs", **{"kubernetes.secret": "llm-secrets"})
    rendered = render_kubernetes(job, ROOT)
    assert SECRET_VALUE not in rendered.text
    service, job_object = yaml.safe_load_all(rendered.text)
    assert validated(service, "V1Service") == service
    assert validated(job_object, "V1Job") == job_object
    assert service["spec"]["clusterIP"] == "None"
    spec = job_object["spec"]
    assert (spec["completionMode"], spec["completions"], spec["parallelism"]) == ("Indexed", 3, 3)
    pod = spec["template"]["spec"]
    assert pod["subdomain"] == service["metadata"]["name"] == "mpt-tiny-demo"
    assert pod["restartPolicy"] == "OnFailure"
    container = pod["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "8"
    secret_env = [e for e in container["env"] if "valueFrom" in e]
    assert secret_env == [
        {
            "name": "WANDB_API_KEY",
            "valueFrom": {"secretKeyRef": {"name": "llm-secrets", "key": "WANDB_API_KEY"}},
        }
    ]
    command = container["command"][2]
    assert "--rdzv_endpoint=mpt-tiny-demo-0.mpt-tiny-demo:29500" in command
    assert "save_folder=s3://bucket/runs/mpt-tiny-demo/checkpoints" in command
    assert "++callbacks.run_status.path=s3://bucket/runs/mpt-tiny-demo/status.json" in command
    assert "llmfoundry.launch.outcome s3://bucket/runs/mpt-tiny-demo/status.json" in command
    subprocess.run(["bash", "-n"], input=command, text=True, check=True, timeout=30)


def test_kubernetes_validation_catches_a_misspelt_field():
    pytest.importorskip("kubernetes")
    _, job_object = kubernetes_objects(big_job(outputs="s3://b/r", **{"kubernetes.secret": "s"}))[0]
    job_object["spec"]["template"]["spec"]["restartPolicyy"] = "Never"
    assert validated(job_object, "V1Job") != job_object


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"outputs": "s3://b/r"}, "kubernetes.secret: secrets WANDB_API_KEY need the name"),
        ({"kubernetes.secret": "s"}, "outputs: 'outputs' is a folder inside each pod"),
        (
            {"kubernetes.secret": "s", "outputs": "s3://b/r", "image": "null"},
            "image: kubernetes runs a container image",
        ),
    ],
)
def test_kubernetes_refusals(extra, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        kubernetes_objects(big_job(**extra))


def test_launch_cli_renders_and_reports_errors_in_one_line(tmp_path, capsys):
    launch = load_script("launch")
    assert (
        launch.main(["render", "slurm", str(EXAMPLE), "--gpus", "16", "--out", str(tmp_path)]) == 0
    )
    assert "slurm: 2 node(s) x 8 GPUs" in capsys.readouterr().out
    assert sbatch_directives((tmp_path / "mpt-tiny-demo.sbatch").read_text())["--nodes"] == "2"
    with pytest.raises(SystemExit) as exited:
        launch.main(["render", "slurm", str(EXAMPLE), "--gpus", "12", "--out", str(tmp_path)])
    assert exited.value.code == 2
    assert (
        "Job error: compute.gpus: 12 GPUs do not fill whole nodes of 8" in capsys.readouterr().err
    )
    with pytest.raises(SystemExit) as exited:
        launch.main(
            ["render", "local", str(EXAMPLE), "--train", "model.n_layer=2", "--out", str(tmp_path)]
        )
    assert exited.value.code == 2
    assert (
        "Job error: model.n_layer: unknown key; did you mean 'n_layers'?" in capsys.readouterr().err
    )


# In a fresh interpreter: what runs.py and the command ending every launched run's script
# (llmfoundry.launch.outcome) import.
_WITHOUT_TORCH = r"""
import importlib, runpy, sys
runpy.run_path("scripts/runs.py")
importlib.import_module("llmfoundry.launch.outcome")
print("torch" in sys.modules)
"""


def test_runs_and_the_end_of_a_launched_run_do_not_import_torch():
    """The status file is read without the trainer: a launched run does not end with seconds of
    importing torch, nor does each `runs.py` command start with them."""
    result = subprocess.run(
        [sys.executable, "-c", _WITHOUT_TORCH],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "False"


def test_launch_cli_refuses_credentials_in_a_train_override_without_showing_them(tmp_path, capsys):
    launch = load_script("launch")
    for override in ("load_path=s3://AKIA:SUPERSECRET@bucket/x", "hf_token=SUPERSECRET"):
        argv = ["render", "slurm", str(EXAMPLE), "--train", override, "--out", str(tmp_path)]
        with pytest.raises(SystemExit) as exited:
            launch.main(argv)
        assert exited.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith("Job error: train: ") and "secrets:" in err
        assert "SUPERSECRET" not in err and err.count("\n") == 1
    assert not list(tmp_path.iterdir())  # nothing rendered


def test_launch_cli_refuses_a_run_name_that_is_not_one_folder_name(tmp_path, capsys):
    """The job's name is one (a DNS label); a --train run_name=, which wins over it, is held to
    the training config's rule before anything is rendered."""
    launch = load_script("launch")
    argv = ["render", "local", str(EXAMPLE), "--train", "run_name=../../x", "--out", str(tmp_path)]
    with pytest.raises(SystemExit) as exited:
        launch.main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("Job error: run_name: '../../x' is not one folder name")
    assert not list(tmp_path.iterdir())


def test_launch_cli_refuses_a_password_in_an_env_url_without_showing_it(tmp_path, capsys):
    """An env value is rendered in clear into the .sbatch and the manifest: a URL's password
    there must come through secrets: instead."""
    launch = load_script("launch")
    for backend in ("slurm", "kubernetes"):
        argv = ["render", backend, str(EXAMPLE), "env.DATABASE_URL=postgres://u:SUPERSECRET@db/x"]
        with pytest.raises(SystemExit) as exited:
            launch.main([*argv, "--out", str(tmp_path)])
        assert exited.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith("Job error: env.DATABASE_URL: 'postgres://<redacted>@db/x' holds")
        assert "under secrets:" in err and "SUPERSECRET" not in err and err.count("\n") == 1
    assert not list(tmp_path.iterdir())  # nothing rendered


def test_kubernetes_submit_creates_service_and_job_and_explains_a_clash(monkeypatch, tmp_path):
    kubernetes = pytest.importorskip("kubernetes")
    from llmfoundry.launch.backends import submit_kubernetes

    created = []

    class Api:
        def create_namespaced_service(self, namespace, body):
            if any(kind == "Service" for kind, _, _ in created):
                raise kubernetes.client.ApiException(status=409, reason="AlreadyExists")
            created.append(("Service", namespace, body))

        def create_namespaced_job(self, namespace, body):
            created.append(("Job", namespace, body))

    api = Api()
    monkeypatch.setattr(kubernetes.config, "load_incluster_config", lambda: None)
    monkeypatch.setattr(kubernetes.client, "CoreV1Api", lambda: api)
    monkeypatch.setattr(kubernetes.client, "BatchV1Api", lambda: api)
    job = big_job(outputs="s3://b/r", **{"kubernetes.secret": "s", "kubernetes.namespace": "ml"})
    assert submit_kubernetes(tmp_path / "unused.yaml", job, ROOT) == 0
    assert [(kind, ns, body["metadata"]["name"]) for kind, ns, body in created] == [
        ("Service", "ml", "mpt-tiny-demo"),
        ("Job", "ml", "mpt-tiny-demo"),
    ]
    with pytest.raises(
        ConfigError, match="already exists in namespace ml; .* delete job/mpt-tiny-demo"
    ):
        submit_kubernetes(tmp_path / "unused.yaml", job, ROOT)


@pytest.mark.parametrize(
    "job_file", sorted((ROOT / "conf/job").glob("*.yaml")), ids=lambda p: p.name
)
@pytest.mark.parametrize("backend", ["slurm", "kubernetes"])
def test_shipped_job_files_render(job_file, backend, tmp_path, capsys):
    """Every job in conf/job/ renders (its training overrides checked against conf/)."""
    pytest.importorskip("kubernetes")
    extra = ["outputs=s3://bucket/runs"] if backend == "kubernetes" else []
    extra += ["kubernetes.secret=llm-secrets"] if backend == "kubernetes" else []
    launch = load_script("launch")
    code = launch.main(["render", backend, str(job_file), *extra, "--out", str(tmp_path)])
    assert code == 0, capsys.readouterr().err
    assert len(list(tmp_path.iterdir())) == 1


def test_memory_is_written_in_each_backends_units():
    """The shipped 24-GPU job asks for 512Gi a node: Kubernetes' quantity, which sbatch refuses
    ('i'); Slurm's G is binary already. Slurm takes whole numbers and units up to T only."""
    job = load_job(ROOT / "conf/job/mpt-1b.yaml")
    assert sbatch_directives(render_slurm(job, ROOT).text)["--mem"] == "512G"
    pod = kubernetes_objects(job)[0][1]["spec"]["template"]["spec"]["containers"][0]
    assert pod["resources"]["limits"]["memory"] == "512Gi"
    cases = {"512G": "512G", "64gi": "64G", "1.5Ti": "1536G", "2Pi": "2048T", "0.5K": "1K"}
    cases["4000"] = "4000"  # (no unit: Slurm's megabytes)
    for memory, slurm in cases.items():
        assert slurm_memory(memory) == slurm, memory


def test_code_from_a_git_repo_is_cloned_at_its_commit(tmp_path):
    """The rendered code lines really clone the repo at the branch and check out the commit."""
    from llmfoundry.launch.command import code_lines

    repo = tmp_path / "repo"
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(repo)]
    subprocess.run(["git", "init", "-q", "-b", "dev", str(repo)], check=True, timeout=30)
    commits = []
    for text in ("one", "two"):
        (repo / "file.txt").write_text(text)
        subprocess.run([*git, "add", "."], check=True, timeout=30)
        subprocess.run([*git, "commit", "-qm", text], check=True, timeout=30)
        head = subprocess.run(
            [*git, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=30
        )
        commits.append(head.stdout.strip())
    job = load_job(EXAMPLE, [f"code.repo={repo}", "code.branch=dev", f"code.commit={commits[0]}"])
    clone = tmp_path / "clone"
    script = "\n".join(["set -euo pipefail", *code_lines(job, None, str(clone)), "cat file.txt"])
    for _ in range(2):  # a restarted node finds the clone and reuses it
        result = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        assert result.stdout.endswith("one")
    slurm = render_slurm(job, ROOT).text
    assert f"git clone --branch dev {repo} {ROOT}/.launch/mpt-tiny-demo/code" in slurm


def test_local_refuses_more_gpus_than_this_machine_has():
    from llmfoundry.launch.backends import local_gpus, render_local

    job = load_job(EXAMPLE, [f"compute.gpus={local_gpus() + 1}"])
    with pytest.raises(ConfigError, match="GPUs asked, this machine has .*; use --gpus 0"):
        render_local(job, ROOT)


def test_a_job_trains_your_own_module_through_train_py(tmp_path, capsys, monkeypatch):
    """The README's job file path for your own module: train overrides with model=custom,
    checked against the package's builder and rendered for scripts/train.py; any other
    `script:` is refused in one line (the launcher passes Hydra overrides and waits for a
    status file only scripts/train.py writes)."""
    from tests.e2e.user_model import write_package

    monkeypatch.syspath_prepend(str(write_package(tmp_path / "pkg")))
    monkeypatch.delitem(sys.modules, "tiny_gpt", raising=False)
    launch = load_script("launch")
    train = ["model=custom", "model._target_=tiny_gpt.build", "+model.width=32"]
    options = [*(f"--train={o}" for o in train), "--out", str(tmp_path)]
    assert launch.main(["render", "local", str(EXAMPLE), *options]) == 0
    command = (tmp_path / "mpt-tiny-demo.sh").read_text()
    torchrun = next(line for line in command.splitlines() if "scripts/train.py" in line)
    assert "model=custom model._target_=tiny_gpt.build +model.width=32 ||" in torchrun
    with pytest.raises(SystemExit) as exited:
        launch.main(["render", "local", str(EXAMPLE), "script=my_train.py", *options])
    assert exited.value.code == 2
    assert (
        "Job error: script: 'my_train.py': a job runs scripts/train.py" in capsys.readouterr().err
    )

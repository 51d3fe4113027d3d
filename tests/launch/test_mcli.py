"""MCLI run files (`mcli run -f`) rendered as jobs: each field mapped or refused by name."""

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from llmfoundry.config import ConfigError
from llmfoundry.launch import load_job
from llmfoundry.launch.backends import kubernetes_objects, render_slurm
from llmfoundry.launch.mcli import LLM_FOUNDRY
from tests.launch.test_render import load_script, sbatch_directives, srun_script

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = Path(__file__).parent / "mcli" / "mpt-125m.yaml"
SECRET_VALUE = "hf_s3cr3tNeverRendered"
K8S = ["image=ghcr.io/example/llmfoundry:v1", "outputs=s3://bucket/runs"]
K8S += ["kubernetes.secret=llm-secrets"]


def run_file(tmp_path: Path, **changes) -> Path:
    """The example run file with top-level fields replaced (None: removed)."""
    run = yaml.safe_load(EXAMPLE.read_text())
    for key, value in changes.items():
        if value is None:
            run.pop(key, None)
        else:
            run[key] = value
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(run, sort_keys=False))
    return path


def written_config(node_script: str) -> dict:
    """The llm-foundry config a node writes, by running the script's heredoc in bash."""
    lines = node_script.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("config_dir="))
    end = lines.index("LLMFOUNDRY_CONFIG_EOF", start)
    script = "\n".join([*lines[start : end + 1], 'cat "$config_dir/parameters.yaml"'])
    result = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)


def expected_config() -> dict:
    """The example's parameters with its command's override merged in, interpolations kept."""
    parameters = yaml.safe_load(EXAMPLE.read_text())["parameters"]
    return {**parameters, "max_duration": "4800ba"}


def test_an_mcli_run_file_renders_for_slurm(tmp_path, capsys):
    launch = load_script("launch")
    assert launch.main(["render", "slurm", str(EXAMPLE), "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "slurm: 2 node(s) x 8 GPUs" in out
    text = (tmp_path / "mpt-125m-pretrain.sbatch").read_text()
    directives = sbatch_directives(text)
    assert (directives["--nodes"], directives["--gpus-per-node"]) == ("2", "8")
    node = srun_script(text)
    # mosaicml/llm-foundry is this project: no clone, the checkout's scripts/train.py runs.
    assert "git clone" not in text and f"cd {ROOT}" in node
    for line in [
        "export RUN_NAME=mpt-125m-pretrain",
        "export NCCL_DEBUG=INFO",
        "export OMP_NUM_THREADS=8",
        "export WANDB_PROJECT=mpt-125m",
        "export WANDB_ENTITY=my-team",
        ': "${WANDB_API_KEY:?secret WANDB_API_KEY is not set in the job environment}"',
        "pip install sentencepiece==0.2.0",
    ]:
        assert line in node.splitlines(), line
    train = next(line for line in node.splitlines() if "-m llmfoundry.launch.torchrun" in line)
    assert "--nnodes=2 --nproc_per_node=8" in train
    assert ' scripts/train.py "$config_dir/parameters.yaml" run_name=mpt-125m-pretrain ' in train
    # The parameters' own save_folder is kept; no strategy= (the config has fsdp_config).
    assert "save_folder=" not in train and "strategy=" not in train
    assert written_config(node) == expected_config()


def test_an_mcli_run_file_renders_for_kubernetes():
    pytest.importorskip("kubernetes")
    from tests.k8s import validated

    objects, layout = kubernetes_objects(load_job(EXAMPLE, K8S, backend="kubernetes"))
    service, job = objects
    assert validated(job, "V1Job") == job and validated(service, "V1Service") == service
    assert (job["spec"]["completions"], layout.procs_per_node) == (2, 8)
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == "ghcr.io/example/llmfoundry:v1"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "8"
    env = {e["name"]: e.get("value") or e["valueFrom"] for e in container["env"]}
    assert env["NCCL_DEBUG"] == "INFO" and env["RUN_NAME"] == "mpt-125m-pretrain"
    assert env["WANDB_API_KEY"] == {"secretKeyRef": {"name": "llm-secrets", "key": "WANDB_API_KEY"}}
    script = container["command"][2]
    assert "cd /workspace/llmfoundry\n" in script  # the image's copy of this project
    assert "pip install sentencepiece==0.2.0\n" in script
    assert ' scripts/train.py "$config_dir/parameters.yaml" run_name=mpt-125m-pretrain ' in script
    assert written_config(script) == expected_config()
    subprocess.run(["bash", "-n"], input=script, text=True, check=True, timeout=30)
    with pytest.raises(ConfigError, match=r"^image: mosaicml/llm-foundry:\S+ is MosaicML's image"):
        kubernetes_objects(load_job(EXAMPLE, K8S[1:], backend="kubernetes"))


def test_a_git_repo_of_this_project_is_cloned_at_its_branch_and_commit(tmp_path):
    """A git_repo other than llm-foundry is the code (this project, or your fork of it)."""
    repo = {"integration_type": "git_repo", "git_repo": "myorg/llmfoundry", "git_branch": "dev"}
    repo |= {"git_commit": "0123abc", "pip_install": "-e .[gpu]", "ssh_clone": True}
    command = "cd llmfoundry\ncomposer scripts/train.py /mnt/config/parameters.yaml\n"
    path = run_file(tmp_path, integrations=[repo], command=command)
    slurm = render_slurm(load_job(path, backend="slurm"), ROOT).text
    clone = f"{ROOT}/.launch/mpt-125m-pretrain/code"
    assert f"git clone --branch dev git@github.com:myorg/llmfoundry.git {clone}" in slurm
    assert "git checkout --detach 0123abc" in slurm
    assert "pip install -e .[gpu]" in srun_script(slurm).splitlines()
    pytest.importorskip("kubernetes")
    job = kubernetes_objects(load_job(path, K8S, backend="kubernetes"))[0][1]
    script = job["spec"]["template"]["spec"]["containers"][0]["command"][2]
    assert "git clone --branch dev git@github.com:myorg/llmfoundry.git /workspace/code" in script
    assert "git checkout --detach 0123abc\n" in script and "pip install -e .[gpu]\n" in script


def test_old_field_spellings_read_as_the_new_ones(tmp_path):
    """Older run files: run_name, gpu_num at the top, env_variables as a list of {key, value}."""
    env = [{"key": "NCCL_DEBUG", "value": "INFO"}, {"key": "OMP_NUM_THREADS", "value": "8"}]
    path = run_file(
        tmp_path, name=None, run_name="old-style", compute=None, gpu_num=8, env_variables=env
    )
    job = load_job(path, backend="slurm")
    assert (job.name, job.compute.gpus, job.env["OMP_NUM_THREADS"]) == ("old-style", 8, "8")


def test_scheduling_retries_are_kubernetes_restarts_and_refused_where_none_happen(tmp_path):
    pytest.importorskip("kubernetes")
    path = run_file(tmp_path, scheduling={"max_retries": 2, "retry_on_system_failure": True})
    job = kubernetes_objects(load_job(path, K8S, backend="kubernetes"))[0][1]
    assert job["spec"]["backoffLimit"] == 4  # 2 restarts of each of 2 pods
    assert "--max-restarts=2 " in job["spec"]["template"]["spec"]["containers"][0]["command"][2]
    with pytest.raises(ConfigError, match=r"^scheduling.max_retries: slurm does not retry"):
        load_job(path, backend="slurm")


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"metadata": {"team": "x"}}, "metadata: cannot be honoured here: a job keeps no metadata"),
        ({"cluster": "r0z0"}, "compute.cluster: cannot be honoured here: a MosaicML platform"),
        ({"compute": {"gpus": 8, "gpu_type": "a100_80gb"}}, "compute.gpu_type: cannot be"),
        ({"compute": {"gpus": 8, "instance": "oci.bm.gpu4.8"}}, "compute.instance: cannot be"),
        (
            {"compute": {"gpus": 8, "cpus": 64}},
            "compute.cpus: cannot be honoured here: MCLI counts",
        ),
        (
            {"compute": {"gpus": 8, "node_names": ["a"]}},
            "compute.node_names: cannot be honoured here: remove it",
        ),
        ({"compute": {"gpu": 8}}, "compute.gpu: unknown key; did you mean 'gpus'?"),
        ({"scheduling": {"priority": "low"}}, "scheduling.priority: cannot be honoured here"),
        ({"scheduling": {"max_duration": 2.5}}, "scheduling.max_duration: cannot be honoured"),
        ({"scheduling": {"preemptible": False}}, "scheduling.preemptible: false cannot be"),
        ({"dependent_deployment": {"x": 1}}, "dependent_deployment: cannot be honoured"),
        ({"parent_name": "other"}, "parent_name: cannot be honoured here"),
        ({"run_name": "x"}, "run_name: given with name; keep name"),
        ({"gpu_num": 8}, "gpu_num: given twice, here and as compute.gpus; keep one"),
        ({"scheduling": {"resumable": False}}, "scheduling.resumable: false cannot be"),
        ({"comand": "x"}, "comand: unknown key; did you mean 'command'?"),
        (
            {"integrations": [{"integration_type": "apt_packages", "packages": ["htop"]}]},
            "integrations.0: apt_packages: runs here install no system packages",
        ),
        (
            {"integrations": [{"integration_type": "comet_ml", "project": "p"}]},
            "integrations.0: integration_type 'comet_ml' has no counterpart here",
        ),
        (
            {
                "integrations": [
                    {"integration_type": "git_repo", "git_repo": "me/one"},
                    {"integration_type": "git_repo", "git_repo": "me/two"},
                ]
            },
            "integrations.1: a second git_repo (me/two); a job runs one code repo",
        ),
        (
            {"integrations": [{"integration_type": "git_repo", "git_repo": "me/x", "tag": "v"}]},
            "integrations.0.tag: unknown key",
        ),
        (
            {
                "command": "cd llm-foundry/scripts\ncomposer train/train.py "
                "/mnt/config/parameters.yaml\npython upload.py"
            },
            "command: 'python upload.py' follows the training line",
        ),
        (
            {"command": "cd /data\ncomposer train/train.py /mnt/config/parameters.yaml"},
            "command: 'cd /data': setup lines run in the code folder",
        ),
        (
            {"command": "composer -n 8 train/train.py /mnt/config/parameters.yaml"},
            "command: composer option '-n': processes and nodes come from compute",
        ),
        (
            {"command": "composer train/train.py train/yamls/pretrain/mpt-1b.yaml"},
            "command: train.py's config 'train/yamls/pretrain/mpt-1b.yaml' is a file of the run's",
        ),
        (
            {"command": "python data_prep/convert_dataset_hf.py --dataset c4"},
            "command: no training line",
        ),
        (
            {"command": "python scripts/train.py max_duration=4ba"},
            "parameters: given, but the command's train.py is not passed /mnt/config/parameters",
        ),
    ],
)
def test_what_cannot_be_honoured_is_refused_by_name_in_one_line(tmp_path, changes, message):
    path = run_file(tmp_path, **changes)
    with pytest.raises(ConfigError) as refused:
        load_job(path, backend="slurm")
    assert str(refused.value).startswith(message) and "\n" not in str(refused.value)


PARAMETERS_LINE = "composer train/train.py /mnt/config/parameters.yaml"


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"env_variables": {"HF_TOKEN": SECRET_VALUE}}, "env_variables.HF_TOKEN: named like a"),
        (
            {"env_variables": [{"key": "WANDB_API_KEY", "value": SECRET_VALUE}]},
            "env_variables.WANDB_API_KEY: named like a secret",
        ),
        (
            {"command": f"export HF_TOKEN={SECRET_VALUE}\n{PARAMETERS_LINE}"},
            "command: a line gives HF_TOKEN a value",
        ),
        (
            {"command": f"huggingface-cli login --token {SECRET_VALUE}\n{PARAMETERS_LINE}"},
            "command: a line gives token a value",
        ),
        (
            {"parameters": {"model": {"name": "hf_causal_lm", "hf_token": SECRET_VALUE}}},
            "parameters.model.hf_token: named like a secret",
        ),
        (
            {"parameters": {"load_path": f"s3://AKIA:{SECRET_VALUE}@bucket/ckpt"}},
            "parameters.load_path: 's3://<redacted>@bucket/ckpt' holds credentials",
        ),
    ],
    ids=["env", "old-env", "export", "flag", "parameters-key", "parameters-url"],
)
def test_a_secret_in_a_run_file_is_refused_and_never_shown_or_rendered(
    tmp_path, capsys, changes, message
):
    launch = load_script("launch")
    path = run_file(tmp_path, **changes)
    out = tmp_path / "rendered"
    with pytest.raises(SystemExit) as exited:
        launch.main(["render", "slurm", str(path), "--out", str(out)])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"Job error: {message}") and err.count("\n") == 1 and "secrets" in err
    assert SECRET_VALUE not in err and not out.exists()


def test_a_secret_read_from_the_environment_passes(tmp_path):
    parameters = {"model": {"name": "hf_causal_lm", "hf_token": "${oc.env:HF_TOKEN}"}}
    command = 'huggingface-cli login --token "$HF_TOKEN"\ncomposer train/train.py ' + (
        "/mnt/config/parameters.yaml"
    )
    path = run_file(tmp_path, parameters=parameters, command=command)
    job = load_job(path, ["secrets=[WANDB_API_KEY,HF_TOKEN]"], backend="slurm")
    assert job.foundry_config == parameters and "HF_TOKEN" in job.secrets
    assert 'huggingface-cli login --token "$HF_TOKEN"' in job.setup


@pytest.mark.slow
def test_submit_local_of_an_mcli_run_file_trains(tmp_path):
    """An MCLI run file as MosaicML's users wrote them (parameters: an llm-foundry train config,
    the command passing it to their train.py), submitted here: a real (tiny) training through
    the translator, its status file finished and `runs.py` listing it."""
    from llmfoundry.models.mpt.hf import from_hf
    from tests.launch.test_local import run

    fixtures = ROOT / "tests" / "fixtures" / "foundry"
    parameters = yaml.safe_load((fixtures / "alibi" / "train.yaml").read_text())
    # (The fixture's llm-foundry-only logger and the folders of the run that made it.)
    for key in ("loggers", "save_folder", "run_name"):
        parameters.pop(key)
    # Their hf_checkpointer, as llm-foundry's finetune YAMLs set it: ours writes the folders.
    exports = tmp_path / "exports"
    hf = {"save_folder": str(exports), "save_interval": "2ba", "precision": "float32"}
    parameters["callbacks"] = {"lr_monitor": {}, "hf_checkpointer": hf}
    parameters["variables"]["data_local"] = str(fixtures / "mds")
    parameters["tokenizer"]["name"] = str(fixtures / "tokenizer")
    repo = {"integration_type": "git_repo", "git_repo": LLM_FOUNDRY, "path": "llm-foundry"}
    path = run_file(
        tmp_path,
        name="mcli-tiny",
        compute={"gpus": 0},
        parameters=parameters,
        command="cd llm-foundry/scripts\ncomposer train/train.py /mnt/config/parameters.yaml "
        "max_duration=4ba",
        integrations=[repo],
        env_variables={"OMP_NUM_THREADS": 1},
    )
    outputs = tmp_path / "outputs"
    rendered = tmp_path / "rendered"
    submit = ["submit", "local", str(path), f"outputs={outputs}", "--out", str(rendered)]
    result = run([str(ROOT / "scripts/launch.py"), *submit], cwd=tmp_path)
    assert "local: 1 node(s) x 1 CPU processes" in result.stdout
    status = yaml.safe_load((outputs / "mcli-tiny" / "status.json").read_text())
    assert (status["status"], status["step"]) == ("finished", 4)
    assert (outputs / "mcli-tiny" / "checkpoints" / "latest").exists()
    assert re.search(r"export RUN_NAME=mcli-tiny\n", (rendered / "mcli-tiny.sh").read_text())
    assert sorted(p.name for p in (exports / "huggingface").iterdir()) == ["ba2", "ba4"]
    # llm-foundry's MPT layout, as its own hf_checkpointer writes it (its default MPT has
    # biases, which transformers' MptForCausalLM lacks), without its remote code.
    folder = exports / "huggingface" / "ba4"
    config = json.loads((folder / "config.json").read_text())
    assert (config["architectures"], config["no_bias"]) == (["MPTForCausalLM"], False)
    assert "auto_map" not in config and from_hf(folder).config.no_bias is False
    listed = run([str(ROOT / "scripts/runs.py"), str(outputs)], cwd=tmp_path).stdout
    assert re.search(r"^mcli-tiny\s+finished\s", listed, re.MULTILINE), listed


def test_the_training_lines_overrides_are_merged_into_the_parameters(tmp_path):
    """As llm-foundry's train.py merges its command line into the file; a shell variable, which
    bash expanded under MCLI, is read from the environment by train.py instead."""
    repo = {"integration_type": "git_repo", "git_repo": LLM_FOUNDRY, "path": "/workspace/lf"}
    command = (
        "cd /workspace/lf/scripts && composer train/train.py /mnt/config/parameters.yaml \\\n"
        "  max_duration=10ba model.n_layers=2 save_folder=s3://b/$RUN_NAME/ckpt"
    )
    path = run_file(tmp_path, integrations=[repo], command=command)
    config = load_job(path, ["foundry_config.precision=fp32"], backend="slurm").foundry_config
    assert (config["max_duration"], config["model"]["n_layers"]) == ("10ba", 2)
    assert config["precision"] == "fp32"  # and launch.py's foundry_config.KEY=VALUE after them
    assert config["save_folder"] == "s3://b/${oc.env:RUN_NAME}/ckpt"
    assert config["max_seq_len"] == "${variables.max_seq_len}"  # train.py resolves it


def test_a_job_file_carries_an_llm_foundry_config_unresolved(tmp_path):
    """foundry_config in a job file: its ${...} are llm-foundry's, not the job file's."""
    job_file = tmp_path / "job.yaml"
    config = {
        "variables": {"n": 2},
        "model": {"name": "mpt_causal_lm", "n_layers": "${variables.n}"},
    }
    job_file.write_text(yaml.safe_dump({"name": "lf", "foundry_config": config}))
    # Its training overrides are llm-foundry's (variables.*), not checked against conf/.
    launch = load_script("launch")
    argv = ["render", "slurm", str(job_file), "--train", "variables.n=4", "--out", str(tmp_path)]
    assert launch.main(argv) == 0
    node = srun_script((tmp_path / "lf.sbatch").read_text())
    assert written_config(node) == config
    assert ' scripts/train.py "$config_dir/parameters.yaml" run_name=lf ' in node
    train_line = node.split("-m llmfoundry.launch.torchrun", 1)[1].splitlines()[0]
    assert train_line.endswith("hydra.run.dir=outputs/lf variables.n=4 || torchrun_exit=$?")

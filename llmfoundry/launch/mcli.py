"""MCLI run files (MosaicML's ``mcli run -f run.yaml``) as job files, for every backend.

A run file names the run, an image, the compute, integrations (a git repo to clone and
pip-install, pip packages, W&B), a shell command, environment variables, the llm-foundry train
config MCLI mounted at ``/mnt/config/parameters.yaml`` (``parameters:``) and scheduling. Each
field becomes the job field that does the same (`job_values`); the command's training line
(``composer train/train.py /mnt/config/parameters.yaml k=v ...``) becomes this project's
``scripts/train.py`` given the parameters (its ``k=v`` merged in, as llm-foundry's train.py
merges them) as its config file (`Job.foundry_config`), and the lines before it setup lines.
A field with no counterpart here is refused by name, with what to use instead: nothing is
dropped silently. Schema: mcli's ``RunConfig`` (mosaicml-cli 0.7), whose ``env_variables`` is a
mapping, or a list of ``{key, value}`` in older files, and whose old top-level ``run_name``,
``gpu_num``, ``gpu_type``, ``cluster`` and ``cpus`` are read as their newer places.

mosaicml/llm-foundry itself, the repo such files clone, is replaced by this project: the run
uses this checkout (local, Slurm) or the image (Kubernetes), as any job without ``code.repo``.
MCLI's secrets live on the platform, not in the run file: list them as the job's ``secrets``
(``secrets=[HF_TOKEN]`` on the command line); README "MCLI run files" maps each kind.
"""

from __future__ import annotations

import logging
import re
import shlex
from collections.abc import Mapping
from pathlib import PurePosixPath
from typing import Any

from omegaconf import OmegaConf

from llmfoundry.config import ConfigError, check_keys
from llmfoundry.launch.clear_text import check_foundry_config, check_setup_line, secret_named
from llmfoundry.utils.errors import UserError

log = logging.getLogger(__name__)

# Where MCLI mounted `parameters:`; the training line names it as its config.
MCLI_PARAMETERS = "/mnt/config/parameters.yaml"
LLM_FOUNDRY = "mosaicml/llm-foundry"
RUN_KEYS = [
    "name",
    "run_name",
    "image",
    "command",
    "compute",
    "scheduling",
    "integrations",
    "env_variables",
    "parameters",
    "metadata",
    "gpu_num",
    "gpu_type",
    "cluster",
    "cpus",
    "parent_name",
    "dependent_deployment",
]
COMPUTE_KEYS = ["gpus", "nodes", "cluster", "gpu_type", "instance", "cpus", "node_names"]
SCHEDULING_KEYS = [
    "priority",
    "preemptible",
    "max_retries",
    "retry_on_system_failure",
    "retryOnSystemFailure",
    "watchdogEnabled",
    "max_duration",
    "resumable",
]
GIT_REPO_KEYS = ["git_repo", "git_branch", "git_commit", "path", "ssh_clone", "pip_install", "host"]
PIP_KEYS = ["packages", "upgrade", "install_index"]
WANDB_ENV = {"project": "WANDB_PROJECT", "entity": "WANDB_ENTITY", "group": "WANDB_RUN_GROUP"}

# Fields with no counterpart here, and what to use instead.
REFUSED = {
    "metadata": "a job keeps no metadata; remove it (comments in the file keep notes)",
    "parent_name": "runs here have no parent run; remove it",
    "dependent_deployment": "deployments are not launched with a run; serve the checkpoint "
    "with scripts/serve.py",
    "compute.cluster": "a MosaicML platform cluster; remove it and pick the place with the "
    "backend and its settings (slurm.partition=NAME, kubernetes.namespace=NAME)",
    "compute.gpu_type": "the backend's nodes decide the GPU type; remove it and pick nodes "
    "with slurm.partition=NAME or slurm.directives=[--constraint=h100] (Kubernetes: "
    "kubernetes.gpu_resource)",
    "compute.instance": "a MosaicML instance type; remove it and pick nodes with "
    "slurm.partition=NAME (Kubernetes: kubernetes.gpu_resource)",
    "compute.node_names": "remove it and name nodes with slurm.directives=[--nodelist=a,b]",
    "compute.cpus": "MCLI counts a run's CPUs; remove it and ask per node: compute.cpus_per_node=N",
    "scheduling.priority": "remove it; a Slurm QoS sets priority: slurm.directives=[--qos=high]",
    "scheduling.max_duration": "a run here is stopped by its training length, not a clock "
    "(Slurm's slurm.time checkpoints and requeues it); remove it and bound the training with "
    "the parameters' max_duration",
}


def job_values(run: Mapping[str, Any], backend: str | None) -> dict[str, Any]:
    """The job file's values for MCLI run file `run`, as submitted to `backend` (retries are
    the backend's); ConfigError naming the run file's field for what cannot be honoured."""
    check_keys("", [str(k) for k in run], RUN_KEYS)
    for key in ("metadata", "parent_name", "dependent_deployment"):
        if run.get(key):
            _refuse(key)
    name = run.get("name") or run.get("run_name")
    if run.get("name") and run.get("run_name"):
        raise ConfigError("run_name", "given with name; keep name (run_name is its old spelling)")
    if not name:
        raise ConfigError("name", "an MCLI run file needs a name (it names the run here too)")
    values: dict[str, Any] = {
        "name": name,
        "compute": _compute(run),
        "env": {"RUN_NAME": str(name)},  # as MCLI sets it
        "setup": [],
        "secrets": [],
    }
    if run.get("image") is not None:
        values["image"] = run["image"]
    code_folders = _integrations(run.get("integrations") or [], values)
    values["env"].update(_env(run.get("env_variables")))
    values.update(_scheduling(_mapping(run, "scheduling"), backend))
    setup, config, overrides = _command(run.get("command"), code_folders)
    values["setup"] += setup
    values.update(_training_config(run.get("parameters") or {}, config, overrides))
    return values


def _training_config(parameters: Any, config: str | None, overrides: list[str]) -> dict[str, Any]:
    """The parameters, with the training line's overrides merged in as llm-foundry's train.py
    merged them (om.from_cli), as the job's foundry_config; without a config file on the
    training line, its overrides are this project's own (scripts/train.py k=v)."""
    if not isinstance(parameters, Mapping):
        raise ConfigError("parameters", "expected a mapping: the llm-foundry train config")
    if config is None:
        if parameters:
            raise ConfigError(
                "parameters",
                f"given, but the command's train.py is not passed {MCLI_PARAMETERS}; pass it "
                "(composer train/train.py /mnt/config/parameters.yaml) or remove parameters",
            )
        return {"train": overrides}
    if not parameters:
        raise ConfigError(
            "parameters", f"empty, but the command passes {MCLI_PARAMETERS} to train.py"
        )
    merged = OmegaConf.merge(OmegaConf.create(dict(parameters)), OmegaConf.from_dotlist(overrides))
    foundry_config = OmegaConf.to_container(merged, resolve=False)
    check_foundry_config(foundry_config, "parameters")
    return {"foundry_config": foundry_config}


def _refuse(key: str) -> None:
    raise ConfigError(key, f"cannot be honoured here: {REFUSED[key]}")


def _mapping(run: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = run.get(key) or {}
    if not isinstance(value, Mapping):
        raise ConfigError(key, f"expected a mapping, got {value!r}")
    return value


def _compute(run: Mapping[str, Any]) -> dict[str, Any]:
    """compute (and its old top-level spellings) as the job's: GPUs in total, as MCLI counted
    them, and nodes (`plan` checks that they agree)."""
    compute = dict(_mapping(run, "compute"))
    for old, new in (("gpu_num", "gpus"), ("gpu_type", "gpu_type"), ("cluster", "cluster")):
        if run.get(old) is not None:
            if compute.get(new) is not None:
                raise ConfigError(old, f"given twice, here and as compute.{new}; keep one")
            compute[new] = run[old]
    if run.get("cpus"):
        _refuse("compute.cpus")
    check_keys("compute", [str(k) for k in compute], COMPUTE_KEYS)
    for key in ("cluster", "gpu_type", "instance", "node_names", "cpus"):
        if compute.get(key) is not None:
            _refuse(f"compute.{key}")
    return {k: compute[k] for k in ("gpus", "nodes") if compute.get(k) is not None}


def _integrations(integrations: Any, values: dict[str, Any]) -> set[str]:
    """Map the integrations into `values` (code, setup, env, secrets); the folders the
    command may cd into for the code (llm-foundry's, or the cloned repo's)."""
    if not isinstance(integrations, list):
        raise ConfigError("integrations", "expected a list of integrations")
    folders: set[str] = set()
    for index, integration in enumerate(integrations):
        where = f"integrations.{index}"
        if not isinstance(integration, Mapping):
            raise ConfigError(where, "expected a mapping with integration_type")
        params = dict(integration)
        kind = params.pop("integration_type", None) or params.pop("type", None)
        if kind == "git_repo":
            folders.add(_git_repo(where, params, values))
        elif kind == "pip_packages":
            values["setup"].append(_pip_packages(where, params))
        elif kind == "wandb":
            check_keys(where, [str(k) for k in params], [*WANDB_ENV, "tags"])
            values["env"].update(
                {WANDB_ENV[k]: str(v) for k, v in params.items() if k in WANDB_ENV}
            )
            if params.get("tags"):
                values["env"]["WANDB_TAGS"] = ",".join(str(t) for t in params["tags"])
            values["secrets"].append("WANDB_API_KEY")  # MCLI's wandb secret
        elif kind == "apt_packages":
            raise ConfigError(
                where,
                "apt_packages: runs here install no system packages; add them to the image "
                "(Dockerfile) or the nodes, and remove the integration",
            )
        else:
            raise ConfigError(
                where,
                f"integration_type {kind!r} has no counterpart here (git_repo, pip_packages and "
                "wandb have); remove it, and set what it configured through env_variables",
            )
    return folders


def _git_repo(where: str, params: dict[str, Any], values: dict[str, Any]) -> str:
    """The repo as `values`' code (clone at branch/commit, pip_install a setup line), or, for
    llm-foundry, this project in its place; the folder MCLI cloned it into."""
    check_keys(where, [str(k) for k in params], GIT_REPO_KEYS)
    repo = params.get("git_repo")
    if not isinstance(repo, str) or not re.fullmatch(r"[\w.-]+(/[\w.-]+)+", repo):
        raise ConfigError(f"{where}.git_repo", f"{repo!r} is not an owner/name repo")
    host = str(params.get("host") or "github.com")
    folder = str(params.get("path") or repo.rsplit("/", 1)[-1])
    if repo == LLM_FOUNDRY and host == "github.com":
        log.info(
            "%s: %s is replaced by this project (this checkout, or the image on Kubernetes); "
            "its pip_install is not run",
            where,
            LLM_FOUNDRY,
        )
        return folder
    if values.get("code"):
        raise ConfigError(
            where,
            f"a second git_repo ({repo}); a job runs one code repo: install this one as a "
            f"package with pip_packages (git+https://{host}/{repo}@<commit>)",
        )
    if not re.fullmatch(r"[\w.-]+", host):
        raise ConfigError(f"{where}.host", f"{host!r} is not a host name")
    url = f"git@{host}:{repo}.git" if params.get("ssh_clone") else f"https://{host}/{repo}.git"
    values["code"] = {"repo": url, "branch": params.get("git_branch")}
    if params.get("git_commit"):
        values["code"]["commit"] = str(params["git_commit"])
    if params.get("pip_install"):
        values["setup"].append(f"pip install {params['pip_install']}")
    return folder


def _pip_packages(where: str, params: dict[str, Any]) -> str:
    check_keys(where, [str(k) for k in params], PIP_KEYS)
    packages = params.get("packages") or []
    if not isinstance(packages, list) or not packages:
        raise ConfigError(f"{where}.packages", "expected a list of packages to pip install")
    words = ["pip", "install", *(["--upgrade"] if params.get("upgrade") else [])]
    if params.get("install_index"):
        words += ["--index-url", str(params["install_index"])]
    return shlex.join([*words, *(str(p) for p in packages)])


def _env(variables: Any) -> dict[str, Any]:
    """env_variables (a mapping, or MCLI's older list of {key, value}) as the job's env;
    secret-named ones are refused: their values would be rendered in clear."""
    if isinstance(variables, list):
        try:
            variables = {v["key"]: v["value"] for v in variables}
        except (KeyError, TypeError):
            raise ConfigError("env_variables", "expected a list of {key, value}") from None
    if not isinstance(variables or {}, Mapping):
        raise ConfigError("env_variables", "expected a mapping of names to values")
    env = {}
    for key, value in (variables or {}).items():
        if secret_named(str(key)):
            raise ConfigError(
                f"env_variables.{key}",
                "named like a secret, and its value would be written in clear into the rendered "
                f"script and manifest; remove it from the run file and pass secrets=[{key}] (the "
                "value then comes from the submitting environment or kubernetes.secret)",
            )
        env[str(key)] = (
            str(value) if isinstance(value, int | float) and not isinstance(value, bool) else value
        )
    return env


def _scheduling(scheduling: Mapping[str, Any], backend: str | None) -> dict[str, Any]:
    """Retries are the backend's: Kubernetes restarts failed pods (kubernetes.max_restarts),
    Slurm requeues only preempted runs, and every run resumes from its last checkpoint."""
    check_keys("scheduling", [str(k) for k in scheduling], SCHEDULING_KEYS)
    for key in ("priority", "max_duration"):
        if scheduling.get(key) is not None:
            _refuse(f"scheduling.{key}")
    # true is what every run does: checkpoint on SIGTERM, resume when started again.
    for key in ("preemptible", "resumable"):
        if scheduling.get(key) is False:
            raise ConfigError(
                f"scheduling.{key}",
                "false cannot be honoured: the launcher cannot keep a run from being "
                "preempted; remove it (a preempted run checkpoints and resumes) or use a Slurm "
                "QoS that does not preempt (slurm.directives=[--qos=NAME])",
            )
    retry = next(
        (
            scheduling[k]
            for k in ("retry_on_system_failure", "retryOnSystemFailure", "watchdogEnabled")
            if scheduling.get(k) is not None
        ),
        None,
    )
    retries = scheduling.get("max_retries")
    if backend != "kubernetes":
        if retry or retries:
            key = "max_retries" if retries else "retry_on_system_failure"
            raise ConfigError(
                f"scheduling.{key}",
                f"{backend or 'this backend'} does not retry a failed run (Slurm requeues "
                "preempted ones); remove it, and submit again to continue a failed run from its "
                "last checkpoint",
            )
        return {}
    if retries is not None:
        return {"kubernetes": {"max_restarts": retries}}
    return {"kubernetes": {"max_restarts": 0}} if retry is False else {}


# A shell variable in a training override (run_name=$RUN_NAME), which bash expanded when MCLI ran
# the command: here the override is merged into the config file, and train.py reads the
# variable from the environment instead (${oc.env:RUN_NAME}). ${a.b} is OmegaConf's own.
_SHELL_VARIABLE = re.compile(r"\$(?:([A-Za-z_]\w*)|\{([A-Za-z_]\w*)\})")
# The command's training line: a launcher, then a train.py.
_LAUNCHERS = {"composer", "torchrun", "python", "python3"}
_MODULE_LAUNCHERS = {"composer", "torch.distributed.run", "torch.distributed.launch"}


def _command(command: Any, code_folders: set[str]) -> tuple[list[str], str | None, list[str]]:
    """(setup lines, the training line's config file or None, its k=v overrides).

    Lines before the training line become setup lines (run in the code folder on each node, as
    MCLI ran the command on each node), but for a ``cd`` into the code, where the job runs
    already; nothing may follow it (a job ends with training and its outcome check)."""
    if not isinstance(command, str) or not command.strip():
        raise ConfigError("command", "expected the run's shell command")
    lines = [line.strip() for line in command.replace("\\\n", " ").splitlines()]
    lines = [line for line in lines if line and not line.startswith("#")]
    setup: list[str] = []
    for index, line in enumerate(lines):
        segments = [s.strip() for s in re.split(r"&&|;", line) if s.strip()]
        parsed = _training(segments[-1])
        if parsed is None:
            if not _cd_into_code(line, code_folders):
                try:
                    check_setup_line(line)
                except UserError as err:  # (named as the run file's field)
                    raise ConfigError("command", str(err).removeprefix("setup: ")) from None
                setup.append(line)
            continue
        for segment in segments[:-1]:
            if not _cd_into_code(segment, code_folders):
                raise ConfigError(
                    "command", f"{segment!r}: put it on a line of its own before the training line"
                )
        if lines[index + 1 :]:
            raise ConfigError(
                "command",
                f"{lines[index + 1][:60]!r} follows the training line; a job ends with training "
                "(and its outcome check): run it in another job, or before training",
            )
        return setup, *parsed
    raise ConfigError(
        "command",
        "no training line (composer train/train.py /mnt/config/parameters.yaml [k=v ...]); "
        "a job runs this project's scripts/train.py",
    )


def _cd_into_code(line: str, code_folders: set[str]) -> bool:
    """Whether `line` is ``cd`` into the code (``cd llm-foundry/scripts``), which the job does
    itself; another ``cd`` is refused: setup lines run in the code folder, where train.py is."""
    try:
        words = shlex.split(line, comments=True)
    except ValueError:  # (unbalanced quotes: not a cd; bash reports it where it runs)
        return False
    if words[:1] != ["cd"]:
        return False
    target = PurePosixPath(words[1]) if len(words) > 1 else PurePosixPath("~")
    if any(PurePosixPath(f) in (target, *target.parents) for f in code_folders):
        return True
    raise ConfigError(
        "command",
        f"{line!r}: setup lines run in the code folder, where scripts/train.py is; cd into a "
        f"folder of it only ({', '.join(sorted(code_folders)) or 'no git_repo given'})",
    )


def _training(segment: str) -> tuple[str | None, list[str]] | None:
    """(config file or None, overrides) if `segment` runs a train.py, else None."""
    try:
        words = shlex.split(segment, comments=True)
    except ValueError:
        return None
    if not words or PurePosixPath(words[0]).name not in _LAUNCHERS:
        return None
    launcher, rest = PurePosixPath(words[0]).name, words[1:]
    if launcher.startswith("python"):
        rest = [w for w in rest if w != "-u"]
        if rest[:1] == ["-m"] and len(rest) > 1 and rest[1] in _MODULE_LAUNCHERS:
            rest = rest[2:]
    script = next((i for i, w in enumerate(rest) if PurePosixPath(w).name == "train.py"), None)
    if script is None:
        return None
    if rest[:script]:
        raise ConfigError(
            "command",
            f"{launcher} option {rest[0]!r}: processes and nodes come from compute (gpus, "
            "nodes); remove it",
        )
    config, overrides = None, rest[script + 1 :]
    if overrides and "=" not in overrides[0]:
        config, overrides = overrides[0], overrides[1:]
    if config is not None and config != MCLI_PARAMETERS:
        raise ConfigError(
            "command",
            f"train.py's config {config!r} is a file of the run's image or repo, not here; put "
            f"its content under parameters: and pass {MCLI_PARAMETERS}",
        )
    for override in overrides:
        if "=" not in override:
            raise ConfigError("command", f"train.py argument {override!r} is not a key=value")
    return config, [_SHELL_VARIABLE.sub(r"${oc.env:\1\2}", o) for o in overrides]

"""The job file: one YAML that describes a training run for every backend (local, Slurm, Kubernetes).

A job names the run, the image, the compute it needs, the code to run, setup commands, plain
environment variables, secrets (names only: their values come from the submitting environment or
a Kubernetes Secret when the job starts, and are never written into a rendered file) and the
training overrides (Hydra ``key=value`` overrides of ``scripts/train.py``). Example: ``conf/job/tiny.yaml``.
An MCLI run file (MosaicML's ``mcli run -f``) is read as a job file too: `llmfoundry.launch.mcli`.

The schema is the dataclasses below; a file is checked against them with the same one-line
`ConfigError` messages as training configs (``compute.gpu: unknown key; did you mean 'gpus'? ...``).
Any field can be overridden from the command line as ``key=value`` (OmegaConf dot-list).
"""

from __future__ import annotations

import dataclasses
import re
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from llmfoundry.config import ConfigError, check_keys, check_type
from llmfoundry.launch.clear_text import (
    FROM_ENV,
    check_foundry_config,
    check_setup_line,
    secret_named,
    url_credentials,
)
from llmfoundry.utils.errors import UserError
from llmfoundry.utils.secrets import redact_urls

# The one script a job runs (`Job.script`).
TRAIN_SCRIPT = "scripts/train.py"
# A DNS-1123 label, short enough for "<name>-<pod index>" hostnames and Slurm job names.
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]{0,38}[a-z0-9])?$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Values that become `#SBATCH` lines: a newline in one would start a shell line on the compute
# node and end sbatch's reading of directives, so every such field has a grammar (\Z: no
# trailing newline either).
_SLURM_NAMES = re.compile(r"[A-Za-z0-9_.+-]+(,[A-Za-z0-9_.+-]+)*\Z")  # partition(s), account
_SLURM_TIME = re.compile(
    r"(\d+|\d+:\d\d|\d+:\d\d:\d\d|\d+-\d+|\d+-\d+:\d\d|\d+-\d+:\d\d:\d\d|UNLIMITED|INFINITE)\Z"
)
_MEMORY = re.compile(r"\d+(\.\d+)?([KMGTPE]i?|[kmgtpe])?\Z")  # 512G (Slurm), 512Gi (Kubernetes)
_DIRECTIVE = re.compile(r"--?[A-Za-z][A-Za-z0-9-]*(=[^\x00-\x1f\x7f]*)?\Z")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def check_train_override(override: str) -> None:
    """A training override that would write credentials in clear into the rendered script and
    manifest (a URL's user-info, a secret-named key's value) is refused, naming `secrets:`."""
    if "=" not in override or override.startswith("-"):
        raise UserError(f"train: {override!r} is not a key=value override")
    key, _, value = override.partition("=")
    if redact_urls(override) != override:
        raise UserError(
            f"train: {redact_urls(override)!r} holds credentials in a URL, which would be "
            "written in clear into the rendered script and manifest; give the URL without them "
            "and the credentials through secrets: (e.g. secrets: [AWS_ACCESS_KEY_ID, "
            "AWS_SECRET_ACCESS_KEY], which the storage backend reads)"
        )
    if secret_named(key) and not FROM_ENV.match(value.strip("'\"")):
        raise UserError(
            f"train: {key}=... is named like a secret, and training overrides are written in "
            f"clear into the rendered script and manifest; list an environment variable under "
            f"secrets: and read it in the override: {key}='${{oc.env:NAME}}'"
        )


@dataclass
class Compute:
    """What the run needs. ``gpus`` in total; 0 trains on CPUs with ``procs_per_node`` processes.

    GPUs become nodes x processes per node (`llmfoundry.launch.layout`): 24 GPUs on nodes of 8
    are 3 nodes of 8. ``gpus_per_node`` null takes the backend's cluster default
    (``slurm.gpus_per_node``, ``kubernetes.gpus_per_node``; local: the GPUs this machine has).
    """

    gpus: int = 0
    gpus_per_node: int | None = None
    procs_per_node: int = 1
    nodes: int | None = None
    cpus_per_node: int | None = None
    # Per node, as Kubernetes writes it ("512Gi"); Slurm's --mem gets "512G" (`slurm_memory`).
    memory: str | None = None

    def __post_init__(self) -> None:
        if self.memory is not None and not _MEMORY.match(self.memory):
            raise UserError(
                f"memory: {self.memory!r} is not a memory size; write a number with a unit, "
                "e.g. 512G (Slurm) or 512Gi (Kubernetes)"
            )
        for key in ("gpus", "gpus_per_node", "procs_per_node", "nodes", "cpus_per_node"):
            value = getattr(self, key)
            if value is not None and value < (0 if key == "gpus" else 1):
                raise UserError(
                    f"{key}: must be {'>= 0' if key == 'gpus' else '>= 1'}, got {value}"
                )


@dataclass
class Code:
    """The code the run executes: a git repo at a branch or commit, or (repo null) the current
    checkout (local and Slurm, which share its filesystem) or the image's own copy (Kubernetes)."""

    repo: str | None = None
    branch: str | None = None
    commit: str | None = None
    # Where the code is, inside the image (Kubernetes) when repo is null.
    workdir: str = "/workspace/llmfoundry"

    def __post_init__(self) -> None:
        if self.repo and url_credentials(self.repo):
            raise UserError(
                "repo: the URL holds a password or token, which would be written into the "
                "rendered script and manifest; give the URL without it and the credentials "
                "through secrets: (e.g. secrets: [GIT_TOKEN] with a git credential helper in "
                "setup:) or an SSH key"
            )
        if (self.branch or self.commit) and not self.repo:
            raise UserError("branch/commit: set code.repo to the git URL they belong to")
        if self.commit and not re.fullmatch(r"[0-9a-f]{7,40}", self.commit):
            raise UserError(f"commit: {self.commit!r} is not a git commit hash")


@dataclass
class Slurm:
    partition: str | None = None
    account: str | None = None
    time: str | None = None  # "2-00:00:00"; the run checkpoints and requeues before it ends
    gpus_per_node: int = 8
    # Seconds before the time limit at which the run is told to checkpoint and stop (SIGTERM).
    grace_s: int = 180
    rdzv_port: int = 29500
    # More #SBATCH lines, e.g. ["--qos=high", "--constraint=h100"].
    directives: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        for key in ("partition", "account"):
            value = getattr(self, key)
            if value is not None and not _SLURM_NAMES.match(value):
                raise UserError(
                    f"{key}: {value!r} is not a Slurm {key} name (letters, digits, '_.+-', "
                    "comma-separated; no spaces or line breaks)"
                )
        if self.time is not None and not _SLURM_TIME.match(self.time):
            raise UserError(
                f"time: {self.time!r} is not a Slurm time limit; write minutes, HH:MM:SS or "
                "D-HH:MM:SS (e.g. 2-00:00:00)"
            )
        for directive in self.directives:
            if not isinstance(directive, str) or not _DIRECTIVE.match(directive):
                raise UserError(
                    f"directives: {directive!r} is not one sbatch option; write each as "
                    "--name=value on one line (no line breaks or control characters)"
                )


@dataclass
class Kubernetes:
    namespace: str = "default"
    gpus_per_node: int = 8
    # The Kubernetes Secret whose keys (named like the job's secrets) hold their values.
    secret: str | None = None
    gpu_resource: str = "nvidia.com/gpu"
    service_account: str | None = None
    # Container restarts of one pod (and torchrun re-rendezvous) before the Job fails.
    max_restarts: int = 3
    rdzv_port: int = 29500


@dataclass
class Job:
    name: str
    image: str | None = None
    compute: Compute = field(default_factory=Compute)
    code: Code = field(default_factory=Code)
    # Shell commands run on every node before training, in the code folder.
    setup: list[str] = field(default_factory=list)
    # Plain variables, rendered in clear: secret-named ones and URLs with a password or token are
    # refused (list them under secrets:).
    env: dict[str, str] = field(default_factory=dict)
    # Names of secret environment variables; values never appear in rendered files.
    secrets: list[str] = field(default_factory=list)
    # Training overrides for scripts/train.py, as on its command line; they are rendered in
    # clear, so credentials in them are refused (`check_train_override`).
    train: list[str] = field(default_factory=list)
    # An llm-foundry train config (MCLI's parameters:), shipped inside the rendered script and
    # given to scripts/train.py as its config file (`train` then holds llm-foundry-style
    # overrides of it). Its ${...} are its own, resolved by train.py, not by the job file.
    foundry_config: dict[str, Any] | None = None
    # Only scripts/train.py: the launcher passes it `train` and the run's own overrides (run
    # name, outputs) and waits for the status file it writes. Your own model goes through it:
    # train: [model=custom, model._target_=my_pkg.build_model] (README, Your own model).
    script: str = TRAIN_SCRIPT
    # Where runs write (a folder, relative to the code, or an fsspec URL): the run's checkpoints
    # and status file go to <outputs>/<name>/. Kubernetes pods share no disk: use a URL there.
    outputs: str = "outputs"
    slurm: Slurm = field(default_factory=Slurm)
    kubernetes: Kubernetes = field(default_factory=Kubernetes)

    def __post_init__(self) -> None:
        for key in ("setup", "secrets", "train"):
            for item in getattr(self, key):
                if not isinstance(item, str):
                    raise UserError(f"{key}: expected strings, got {item!r}; quote it")
        if self.script != TRAIN_SCRIPT:
            raise UserError(
                f"script: {self.script!r}: a job runs {TRAIN_SCRIPT} (Hydra overrides, a run "
                "status file); for your own model set train: [model=custom, "
                "model._target_=my_pkg.build_model] (README, Your own model)"
            )
        if not _NAME.match(self.name):
            raise UserError(
                f"name: {self.name!r} must be lowercase letters, digits and '-', at most 40 "
                "characters (it names Slurm jobs, Kubernetes objects and the run folder)"
            )
        for key, value in self.env.items():
            if not _ENV_NAME.match(key):
                raise UserError(f"env.{key}: not a valid environment variable name")
            if key not in self.secrets and secret_named(key):
                raise UserError(
                    f"env.{key}: named like a secret, and env values are written into the "
                    f"rendered script and manifest; list {key} under secrets: instead (its value "
                    "then comes from the submitting environment or the Kubernetes Secret)"
                )
            if not isinstance(value, str):
                raise UserError(f"env.{key}: expected a string, got {value!r}; quote it")
            if url_credentials(value):
                raise UserError(
                    f"env.{key}: {redact_urls(value)!r} holds credentials in a URL, and env "
                    f"values are written into the rendered script and manifest; list {key} "
                    "under secrets: instead (its value then comes from the submitting "
                    "environment or the Kubernetes Secret)"
                )
        for name in self.secrets:
            if not _ENV_NAME.match(name):
                raise UserError(f"secrets: {name!r} is not a valid environment variable name")
            if name in self.env:
                raise UserError(
                    f"env.{name}: also listed in secrets; remove it from env (a secret's value "
                    "comes from the environment or a Kubernetes Secret, never from the job file)"
                )
        for override in self.train:
            check_train_override(override)
        for line in self.setup:
            check_setup_line(line)
        if self.foundry_config is not None:
            check_foundry_config(self.foundry_config)
        if not self.outputs or _CONTROL.search(self.outputs):
            raise UserError(
                f"outputs: {self.outputs!r} is not a folder or URL; write it on one line, "
                "without control characters (e.g. outputs or s3://bucket/runs)"
            )
        if redact_urls(self.outputs) != self.outputs:
            raise UserError(
                f"outputs: {redact_urls(self.outputs)!r} holds credentials, which would be "
                "written in clear into the rendered script and manifest; give the URL without "
                "them and the credentials through secrets: (e.g. AWS_ACCESS_KEY_ID, "
                "AWS_SECRET_ACCESS_KEY)"
            )


def load_job(
    path: str | Path,
    overrides: Sequence[str] = (),
    train: Sequence[str] = (),
    backend: str | None = None,
) -> Job:
    """Read a job file (or an MCLI run file, mapped onto one for `backend`), apply ``key=value``
    overrides, add the training overrides `train` (``--train``) to its own, and check it all
    (raises ConfigError)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError("", f"no job file at {path}; see conf/job/tiny.yaml for an example")
    try:
        cfg = OmegaConf.load(path)
        # An MCLI run file knows no ${...} of OmegaConf's: its ${VAR} are bash's, kept as text.
        mcli = isinstance(cfg, DictConfig) and "command" in cfg
        if mcli:
            from llmfoundry.launch.mcli import job_values

            run = OmegaConf.to_container(cfg, resolve=False)
            cfg = OmegaConf.create(job_values(run, backend))  # type: ignore[arg-type]
        # Its ${...} belong to the llm-foundry config (train.py resolves them), not to the job.
        foundry = cfg.pop("foundry_config", None) if isinstance(cfg, DictConfig) else None
        ours, foundry_overrides = _split_foundry_overrides(overrides)
        if foundry_overrides:
            foundry = OmegaConf.merge(foundry or {}, OmegaConf.from_dotlist(foundry_overrides))
        if ours:
            cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(ours))
        values = OmegaConf.to_container(cfg, resolve=not mcli)
    except OmegaConfBaseException as err:
        raise ConfigError(getattr(err, "full_key", "") or "", str(err).splitlines()[0]) from None
    except yaml.YAMLError as err:  # a value YAML cannot read (a backtick, an unclosed quote)
        where = f"{path} or its overrides" if overrides else str(path)
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(
            "", f"{where}: YAML cannot read a value ({problem}); quote it, e.g. key='value'"
        ) from None
    if not isinstance(values, dict):
        raise ConfigError("", f"{path} must hold a mapping of job fields, e.g. name: my-run")
    if foundry is not None:
        values["foundry_config"] = (
            OmegaConf.to_container(foundry, resolve=False)
            if isinstance(foundry, DictConfig | ListConfig)
            else foundry
        )
    if train:
        own = values.get("train") or []
        values["train"] = [*own, *train] if isinstance(own, list) else own
    return build_dataclass("", values, Job)


def _split_foundry_overrides(overrides: Sequence[str]) -> tuple[list[str], list[str]]:
    """(the job's overrides, those of its llm-foundry config: foundry_config.KEY=VALUE without
    the prefix, merged unresolved as the config is)."""
    ours, theirs = [], []
    for override in overrides:
        if override.startswith("foundry_config="):
            raise ConfigError("foundry_config", "set its keys one by one: foundry_config.KEY=VALUE")
        if override.startswith("foundry_config."):
            theirs.append(override.removeprefix("foundry_config."))
        else:
            ours.append(override)
    return ours, theirs


def build_dataclass(path: str, values: Mapping[str, Any], cls: type) -> Any:
    """Build `cls` from plain values, checking keys and types field by field (nested too)."""
    hints = typing.get_type_hints(cls)
    check_keys(path, [str(k) for k in values], list(hints))
    kwargs: dict[str, Any] = {}
    for name, value in values.items():
        key = f"{path}.{name}" if path else str(name)
        annotation = hints[name]
        if dataclasses.is_dataclass(annotation):
            if not isinstance(value, (dict, DictConfig)):
                raise ConfigError(key, f"expected a mapping of {annotation.__name__} fields")
            kwargs[name] = build_dataclass(key, value, annotation)
            continue
        if isinstance(value, (DictConfig, ListConfig)):
            value = OmegaConf.to_container(value)
        check_type(key, value, annotation)
        kwargs[name] = value
    missing = [
        f.name
        for f in dataclasses.fields(cls)
        if f.name not in kwargs
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ConfigError(path, f"missing required key(s) {', '.join(missing)}")
    try:
        return cls(**kwargs)
    except ValueError as err:
        key, _, message = str(err).partition(": ")
        full = f"{path}.{key}" if path else key
        raise ConfigError(full if message else path, message or str(err)) from None

"""What runs on every node, for every backend: get the code, check secrets, set up, torchrun.

Each backend wraps the same bash lines: the local backend runs them as a script, Slurm runs them
once per node under ``srun``, Kubernetes as each pod's command. The run is named after the job
and resumes itself (``autoresume=true``, checkpoints in ``<outputs>/<name>/checkpoints``), so a
requeued Slurm job or a restarted pod continues where it stopped. After torchrun exits,
`llmfoundry.launch.outcome` reads the run's status file and tells the scheduler whether the run
finished (0), was stopped to be continued (75) or failed, see there.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence

import yaml

from llmfoundry.launch.job import Job
from llmfoundry.launch.layout import Layout
from llmfoundry.utils.errors import UserError

# Exit status of a run that stopped early to be continued (preempted): EX_TEMPFAIL.
RESUME_EXIT = 75
# The heredoc delimiter of a job's llm-foundry config, and the file it becomes on each node
# (`$config_dir`: a folder of the node's own, from mktemp).
CONFIG_EOF = "LLMFOUNDRY_CONFIG_EOF"
CONFIG_FILE = '"$config_dir/parameters.yaml"'
# Seconds the outcome check waits for rank 0 to record how the run ended.
OUTCOME_WAIT_S = 120


def is_url(path: str) -> bool:
    return "://" in path


def run_folder(job: Job) -> str:
    return f"{job.outputs.rstrip('/')}/{job.name}"


def status_path(job: Job) -> str:
    return f"{run_folder(job)}/status.json"


def train_overrides(job: Job, layout: Layout) -> list[str]:
    """The job's overrides plus what launching needs: a stable run name and folder, autoresume,
    the status file (always on: the outcome check reads it), and DDP when there are several
    processes and the job picked no strategy."""
    folder = run_folder(job)
    overrides = [f"run_name={job.name}", "autoresume=true"]
    # An llm-foundry config's own save_folder (s3://bucket/{run_name}/checkpoints) is kept.
    if not (job.foundry_config or {}).get("save_folder"):
        overrides.append(f"save_folder={folder}/checkpoints")
    overrides.append("++callbacks.run_status._target_=llmfoundry.callbacks.RunStatus")
    if is_url(job.outputs):  # else the run folder is the Hydra run dir, which holds status.json
        overrides.append(f"++callbacks.run_status.path={status_path(job)}")
    else:
        overrides.append(f"hydra.run.dir={folder}")
    # (An llm-foundry config picks its own: DDP, or FSDP with its fsdp_config.)
    native = job.foundry_config is None
    if native and layout.world_size > 1 and not any(o.startswith("strategy=") for o in job.train):
        overrides.append("strategy=ddp")
    # The job's own overrides come last, so they win over the defaults above.
    return overrides + list(job.train)


def torchrun(python: str, layout: Layout, rendezvous: Sequence[str], script: str) -> str:
    """The torchrun command line, without the training overrides."""
    args = [
        f"--nnodes={layout.nodes}",
        f"--nproc_per_node={layout.procs_per_node}",
        *rendezvous,
    ]
    return " ".join([python, "-m", "torch.distributed.run", *args, shlex.quote(script)])


def code_lines(job: Job, checkout: str | None, clone_dir: str) -> list[str]:
    """cd into the code: a clone of code.repo into `clone_dir` (kept, so a restarted node reuses
    it), else `checkout` (the launching checkout, on a shared disk) or the image's workdir."""
    if not job.code.repo:
        return [f"cd {shlex.quote(checkout or job.code.workdir)}"]
    repo = shlex.quote(job.code.repo)
    target = shlex.quote(clone_dir)
    branch = f" --branch {shlex.quote(job.code.branch)}" if job.code.branch else ""
    lines = [
        f"if [ ! -d {target}/.git ]; then git clone{branch} {repo} {target}; fi",
        f"cd {target}",
    ]
    if job.code.commit:
        lines.append(f"git checkout --detach {shlex.quote(job.code.commit)}")
    return lines


def secret_lines(job: Job) -> list[str]:
    """Fail early, by name, when a secret is missing; values are only read from the environment."""
    return [
        f': "${{{name}:?secret {name} is not set in the job environment}}"' for name in job.secrets
    ]


def env_lines(job: Job) -> list[str]:
    return [f"export {key}={shlex.quote(value)}" for key, value in job.env.items()]


def config_lines(job: Job) -> list[str]:
    """Write the job's llm-foundry config to `CONFIG_FILE` on this node: a heredoc, so the file
    travels inside the rendered script or manifest to every backend (Kubernetes pods share no
    disk with the launcher), exactly as rendered for you to read. Quoted: bash expands nothing
    in it, and its ${...} reach train.py as written."""
    if job.foundry_config is None:
        return []
    text = yaml.safe_dump(job.foundry_config, sort_keys=False, width=100)
    if CONFIG_EOF in text.splitlines():
        raise UserError(f"foundry_config: a line of it is {CONFIG_EOF}; change that value")
    return [
        'config_dir="$(mktemp -d)"',
        f"cat > {CONFIG_FILE} <<'{CONFIG_EOF}'",
        *text.splitlines(),
        CONFIG_EOF,
    ]


def node_script(
    job: Job,
    layout: Layout,
    python: str,
    rendezvous: Sequence[str],
    code: Sequence[str],
    export_env: bool = True,
) -> str:
    """Bash for one node: `code` (lines from `code_lines`, or a cd where the launcher already
    put it), secrets, env, setup, the llm-foundry config if the job has one (train.py's first
    argument), then torchrun and the outcome check."""
    train = " ".join(shlex.quote(o) for o in train_overrides(job, layout))
    if job.foundry_config is not None:
        train = f"{CONFIG_FILE} {train}"
    lines = [
        "set -euo pipefail",
        *code,
        *secret_lines(job),
        *(env_lines(job) if export_env else []),
        *job.setup,
        *config_lines(job),
        # Schedulers send SIGTERM to every process of the job: the trainers checkpoint and
        # stop, torchrun's agent exits non-zero, and this shell must live on to report.
        "trap 'echo \"node: SIGTERM received; the run checkpoints and stops\"' TERM",
        "torchrun_exit=0",
        f"{torchrun(python, layout, rendezvous, job.script)} {train} || torchrun_exit=$?",
        f"{python} -m llmfoundry.launch.outcome {shlex.quote(status_path(job))} "
        f'--wait {OUTCOME_WAIT_S} --exit-code "$torchrun_exit"',
    ]
    return "\n".join(lines) + "\n"

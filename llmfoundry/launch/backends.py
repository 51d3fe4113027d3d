"""Render a job for each backend, and submit what was rendered.

- local: a bash script running torchrun with a standalone rendezvous on this machine (CPU
  processes talk over gloo, GPUs over NCCL).
- slurm: an sbatch script. One torchrun per node under ``srun``, meeting at a c10d rendezvous on
  the job's first node (``--rdzv_id`` the Slurm job id, which a requeued job keeps). Slurm sends
  SIGTERM ``slurm.grace_s`` seconds before the time limit (``--signal``) and on preemption; the
  trainer checkpoints and stops, and the script requeues the job when the run is unfinished
  (exit 75 from the outcome check); ``autoresume`` continues it. Logs: ``<run folder>/slurm-<id>.log``.
- kubernetes: an indexed Job and a headless Service (plain batch/v1 and v1 objects: every
  cluster has them, no operator such as JobSet or the Kubeflow training operator has to be
  installed, and the official client validates them). Pod i of an indexed Job is reachable as
  ``<name>-<i>.<name>``; torchrun's c10d rendezvous runs on pod 0. Pods restart on failure
  (``restartPolicy: OnFailure``, up to ``kubernetes.max_restarts``); a restarted container
  rejoins the rendezvous and every worker resumes from the last checkpoint, and a preempted run
  exits 75, a failure, so it is restarted too. Secrets are ``secretKeyRef`` entries
  naming keys of ``kubernetes.secret``.
"""

from __future__ import annotations

import logging
import math
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmfoundry.config import ConfigError
from llmfoundry.launch.command import (
    RESUME_EXIT,
    code_lines,
    is_url,
    node_script,
    run_folder,
)
from llmfoundry.launch.job import Job
from llmfoundry.launch.layout import Layout, plan
from llmfoundry.utils.errors import UserError
from llmfoundry.utils.status_file import KUBERNETES_JOB_ENV

_CONTROL_OR_BACKSLASH = re.compile(r"[\x00-\x1f\x7f\\]")

log = logging.getLogger(__name__)


@dataclass
class Rendered:
    """A rendered job: the file's name and text, and the layout it was rendered for."""

    filename: str
    text: str
    layout: Layout


def clone_dir(job: Job, checkout: Path) -> Path:
    """Where local and Slurm runs clone code.repo: beside the launching checkout (shared disk)."""
    return checkout / ".launch" / job.name / "code"


def local_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def render_local(job: Job, checkout: Path) -> Rendered:
    if job.compute.gpus and job.compute.gpus > local_gpus():
        raise ConfigError(
            "compute.gpus",
            f"{job.compute.gpus} GPUs asked, this machine has {local_gpus()}; use --gpus 0 "
            "(CPU processes: compute.procs_per_node) or the slurm/kubernetes backend",
        )
    layout = plan(job.compute, max(local_gpus(), 1), max_nodes=1)
    code = code_lines(job, str(checkout), str(clone_dir(job, checkout)))
    body = node_script(job, layout, shlex.quote(sys.executable), ["--standalone"], code)
    return Rendered(f"{job.name}.sh", "#!/bin/bash\n" + body, layout)


def slurm_log_dir(job: Job, checkout: Path) -> str:
    """Where Slurm writes the job's log: the run folder, or (outputs on an object store, which
    Slurm cannot write) the launching checkout's .launch/<name>."""
    if is_url(job.outputs):
        return f"{checkout}/.launch/{job.name}"
    folder = run_folder(job)
    workdir = str(clone_dir(job, checkout)) if job.code.repo else str(checkout)
    return folder if folder.startswith("/") else f"{workdir}/{folder}"


def sbatch_path(folder: str, name: str) -> str:
    """The file `name` (a Slurm file name pattern, e.g. slurm-%j.log) in `folder` as one
    argument of an #SBATCH line, in double quotes: sbatch splits its lines at spaces and ends
    them at an unquoted '#', reads backslash escapes, and expands '%' patterns in file names
    ('%%' is a '%'). A backslash left in a file name turns the patterns off, so it is refused,
    as are control characters."""
    if _CONTROL_OR_BACKSLASH.search(folder):
        raise ConfigError(
            "outputs",
            f"the Slurm log folder {folder!r} holds a backslash or a control character, which "
            "sbatch cannot take in a file name; use another outputs folder or checkout path",
        )
    return '"' + folder.replace('"', '\\"').replace("%", "%%") + f'/{name}"'


_QUANTITY = re.compile(r"(\d+)(?:\.(\d+))?([KMGTPEkmgtpe])?i?")
_SLURM_UNITS = "KMGTPE"


def slurm_memory(memory: str) -> str:
    """`compute.memory` as sbatch's --mem reads it. One job file serves both backends, and
    Kubernetes writes binary units as 512Gi where Slurm writes 512G (its K/M/G/T are binary
    already) and refuses the 'i'; Slurm also takes only whole numbers and units up to T, so
    1.5Ti is 1536G and 2Pi is 2048T. A number without a unit is Slurm's own (megabytes)."""
    match = _QUANTITY.fullmatch(memory)
    if match is None:  # (`Compute` checked the grammar: this is a programming error)
        raise ValueError(f"not a memory size: {memory!r}")
    whole, fraction, unit = match.groups()
    if unit is None:
        return whole
    power = _SLURM_UNITS.index(unit.upper())
    value = float(f"{whole}.{fraction or 0}")
    while power > 0 and (power > _SLURM_UNITS.index("T") or value != int(value)):
        power, value = power - 1, value * 1024
    return f"{math.ceil(value)}{_SLURM_UNITS[power]}"


def render_slurm(job: Job, checkout: Path) -> Rendered:
    slurm = job.slurm
    layout = plan(job.compute, slurm.gpus_per_node)
    # The code is fetched once, on the first node, into the shared disk; nodes cd there.
    clone = str(clone_dir(job, checkout))
    workdir = clone if job.code.repo else str(checkout)
    directives = [
        f"--job-name={job.name}",
        f"--nodes={layout.nodes}",
        "--ntasks-per-node=1",
        f"--output={sbatch_path(slurm_log_dir(job, checkout), 'slurm-%j.log')}",
        "--open-mode=append",
        "--requeue",
        f"--signal=TERM@{slurm.grace_s}",
    ]
    if layout.gpus_per_node:
        directives.append(f"--gpus-per-node={layout.gpus_per_node}")
    if job.compute.cpus_per_node:
        directives.append(f"--cpus-per-task={job.compute.cpus_per_node}")
    if job.compute.memory:
        directives.append(f"--mem={slurm_memory(job.compute.memory)}")
    for key in ("partition", "account", "time"):
        value = getattr(slurm, key)
        if value:
            directives.append(f"--{key}={value}")
    directives += slurm.directives
    rendezvous = [
        "--rdzv_backend=c10d",
        f'--rdzv_endpoint="$LAUNCH_HEAD_NODE:{slurm.rdzv_port}"',
        '--rdzv_id="$SLURM_JOB_ID"',
    ]
    # The current checkout's Python (a venv on the shared disk), else the image's or setup's.
    python = "python3" if job.code.repo else shlex.quote(sys.executable)
    node = node_script(job, layout, python, rendezvous, [f"cd {shlex.quote(workdir)}"])
    lines = [
        "#!/bin/bash",
        *(f"#SBATCH {d}" for d in directives),
        f"# Rendered by scripts/launch.py: {layout.nodes} node(s) x {layout.procs_per_node} "
        "process(es). Secrets come from the submitting environment (sbatch exports it).",
        "set -euo pipefail",
        *code_lines(job, str(checkout), clone),
        'export LAUNCH_HEAD_NODE="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"',
        "rc=0",
        f"srun --nodes={layout.nodes} --ntasks-per-node=1 --kill-on-bad-exit=1 "
        f"bash -c {shlex.quote(node)} || rc=$?",
        f'if [ "$rc" -eq {RESUME_EXIT} ]; then',
        '  echo "run unfinished (preempted or out of time): requeueing job $SLURM_JOB_ID"',
        '  scontrol requeue "$SLURM_JOB_ID"',
        "  exit 0",
        "fi",
        'exit "$rc"',
    ]
    return Rendered(f"{job.name}.sbatch", "\n".join(lines) + "\n", layout)


def kubernetes_objects(job: Job) -> tuple[list[dict[str, Any]], Layout]:
    """The headless Service and the indexed Job, as plain dicts (the API's JSON shape)."""
    k8s = job.kubernetes
    layout = plan(job.compute, k8s.gpus_per_node)
    if not job.image:
        raise ConfigError(
            "image", "kubernetes runs a container image; set image=<registry/name:tag>"
        )
    if re.match(r"(docker\.io/)?mosaicml/", job.image):  # (an MCLI run file's image)
        raise ConfigError(
            "image",
            f"{job.image} is MosaicML's image, which holds llm-foundry, not this project; "
            "build this project's (make image IMAGE=<registry/name:tag>), then pass "
            "image=<registry/name:tag>",
        )
    if layout.nodes > 1 and not is_url(job.outputs):
        raise ConfigError(
            "outputs",
            f"{job.outputs!r} is a folder inside each pod, lost when a pod restarts and not "
            "shared between nodes; set outputs to a URL (s3://bucket/runs, gs://...)",
        )
    if job.secrets and not k8s.secret:
        raise ConfigError(
            "kubernetes.secret",
            f"secrets {', '.join(job.secrets)} need the name of the Kubernetes Secret holding "
            "them (kubectl create secret generic <name> --from-literal=NAME=...)",
        )
    name, labels = job.name, {"app.kubernetes.io/name": "llmfoundry", "llmfoundry/job": job.name}
    rendezvous = [
        "--rdzv_backend=c10d",
        f"--rdzv_endpoint={name}-0.{name}:{k8s.rdzv_port}",
        f"--rdzv_id={name}",
        f"--max-restarts={k8s.max_restarts}",
    ]
    code = code_lines(job, None, "/workspace/code")
    # The environment is in the container spec, where Kubernetes shows it.
    script = node_script(job, layout, "python3", rendezvous, code, export_env=False)
    env: list[dict[str, Any]] = [{"name": k, "value": v} for k, v in job.env.items()]
    # What the run's status file records, so `scripts/runs.py stop` finds the Job.
    env.append({"name": KUBERNETES_JOB_ENV, "value": f"{k8s.namespace}/{name}"})
    env += [
        {"name": s, "valueFrom": {"secretKeyRef": {"name": k8s.secret, "key": s}}}
        for s in job.secrets
    ]
    # Quantities are strings in the API ("8", "512Gi").
    resources: dict[str, Any] = {"limits": {}, "requests": {}}
    if layout.gpus_per_node:
        resources["limits"][k8s.gpu_resource] = str(layout.gpus_per_node)
        resources["requests"][k8s.gpu_resource] = str(layout.gpus_per_node)
    if job.compute.cpus_per_node:
        resources["requests"]["cpu"] = str(job.compute.cpus_per_node)
    if job.compute.memory:
        resources["requests"]["memory"] = job.compute.memory
        resources["limits"]["memory"] = job.compute.memory
    container = {
        "name": "train",
        "image": job.image,
        "command": ["bash", "-c", script],
        "env": env,
        "ports": [{"containerPort": k8s.rdzv_port, "name": "rendezvous"}],
        "resources": {k: v for k, v in resources.items() if v},
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
    }
    pod_spec: dict[str, Any] = {
        "subdomain": name,
        "restartPolicy": "OnFailure",
        "containers": [container],
        # NCCL and data loader workers share memory through /dev/shm, 64 MB by default.
        "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory"}}],
    }
    if k8s.service_account:
        pod_spec["serviceAccountName"] = k8s.service_account
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": k8s.namespace, "labels": labels},
        "spec": {
            "clusterIP": "None",
            # Pod 0's name resolves before it is ready, so the rendezvous can start.
            "publishNotReadyAddresses": True,
            "selector": {"llmfoundry/job": name},
            "ports": [{"port": k8s.rdzv_port, "name": "rendezvous"}],
        },
    }
    job_object = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "namespace": k8s.namespace, "labels": labels},
        "spec": {
            "completionMode": "Indexed",
            "completions": layout.nodes,
            "parallelism": layout.nodes,
            "backoffLimit": k8s.max_restarts * layout.nodes,
            "template": {"metadata": {"labels": labels}, "spec": pod_spec},
        },
    }
    return [service, job_object], layout


def render_kubernetes(job: Job, checkout: Path) -> Rendered:
    import yaml

    class Dumper(yaml.SafeDumper):
        """Multi-line strings (the pods' script) as readable literal blocks; no anchors."""

        def ignore_aliases(self, data: Any) -> bool:
            return True

    def string(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
        style = "|" if "\n" in value else None
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)

    Dumper.add_representer(str, string)
    objects, layout = kubernetes_objects(job)
    text = yaml.dump_all(objects, Dumper=Dumper, sort_keys=False)
    return Rendered(f"{job.name}.yaml", text, layout)


def submit_local(path: Path, job: Job, checkout: Path, detach: bool = False) -> int:
    """Run the rendered script here, its output also in <run folder>/launch.log (next to the
    script when the run folder is a URL).

    Ctrl-C reaches the whole process group: the trainers checkpoint after the current batch and
    stop (exit 75, `RESUME_EXIT`; run the same command to continue), so the first one only keeps
    this process relaying their output; a second one stops at once.

    `detach`: start it in a session of its own, its output in launch.log only, and return at
    once, as the Slurm and Kubernetes backends do (closing the terminal does not stop it;
    ``scripts/runs.py logs NAME -f`` follows it, ``scripts/runs.py stop NAME`` stops it).
    """
    missing = [s for s in job.secrets if s not in os.environ]
    if missing:
        raise ConfigError("secrets", f"{', '.join(missing)} not set in this environment")
    code_dir = clone_dir(job, checkout) if job.code.repo else checkout
    folder = Path(path).parent if is_url(job.outputs) else code_dir / run_folder(job)
    folder.mkdir(parents=True, exist_ok=True)
    log = folder / "launch.log"
    if detach:
        with open(log, "ab") as sink:
            process = subprocess.Popen(
                ["bash", str(path)],
                stdin=subprocess.DEVNULL,
                stdout=sink,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        root = "" if job.outputs == "outputs" else f" {shlex.quote(job.outputs)}"
        print(
            f"started {job.name} in the background (pid {process.pid}), its output in {log}\n"
            f"  follow: python scripts/runs.py logs {job.name}{root} -f\n"
            f"  stop:   python scripts/runs.py stop {job.name}{root}"
        )
        return 0
    with open(log, "ab") as sink:
        process = subprocess.Popen(
            ["bash", str(path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        assert process.stdout is not None
        interrupted = False
        while True:
            try:
                for chunk in iter(process.stdout.readline, b""):
                    sys.stdout.buffer.write(chunk)
                    sys.stdout.flush()
                    sink.write(chunk)
                    sink.flush()
                return process.wait()
            except KeyboardInterrupt:
                if interrupted:
                    raise
                interrupted = True


def submit_slurm(path: Path, job: Job, checkout: Path) -> int:
    missing = [s for s in job.secrets if s not in os.environ]
    if missing:
        raise ConfigError("secrets", f"{', '.join(missing)} not set in this environment")
    # Slurm opens the log file before the script runs, so its folder must exist already.
    Path(slurm_log_dir(job, checkout)).mkdir(parents=True, exist_ok=True)
    result = subprocess.run(["sbatch", "--parsable", str(path)], capture_output=True, text=True)
    if result.returncode:
        raise UserError(f"sbatch failed: {result.stderr.strip()}")
    log.info("submitted Slurm job %s (%s)", result.stdout.strip(), job.name)
    return 0


def submit_kubernetes(path: Path, job: Job, checkout: Path) -> int:
    from kubernetes import client, config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    service, job_object = kubernetes_objects(job)[0]
    namespace = job.kubernetes.namespace
    try:
        client.CoreV1Api().create_namespaced_service(namespace, service)
        client.BatchV1Api().create_namespaced_job(namespace, job_object)
    except client.ApiException as err:
        if err.status == 409:
            raise ConfigError(
                "name",
                f"{job.name} already exists in namespace {namespace}; to run it again (it "
                f"continues from its checkpoints) first: kubectl -n {namespace} delete "
                f"job/{job.name} service/{job.name}",
            ) from None
        raise
    log.info("created Service and Job %s in namespace %s", job.name, namespace)
    return 0


BACKENDS: dict[str, tuple[Callable[[Job, Path], Rendered], Callable[[Path, Job, Path], int]]] = {
    "local": (render_local, submit_local),
    "slurm": (render_slurm, submit_slurm),
    "kubernetes": (render_kubernetes, submit_kubernetes),
}

"""A real sbatch submission on a one-machine Slurm cluster started for the test.

Needs Debian's slurm-wlm and munge (`apt-get install slurm-wlm munge`) and root (slurmd); skips
with the reason otherwise. The cluster (munged, slurmctld, slurmd on free ports, state in a
temporary folder) is started once for the module and stopped after it.

The preemption test sends the job SIGTERM as a scheduler does: the trainers checkpoint, the
script requeues the job, and the requeued job resumes and finishes. Slurm holds a requeued job
for about two minutes before it starts again, so that test runs only with
LLMFOUNDRY_SLURM_REQUEUE_TEST=1.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.checkpoint.helpers import SEQ_LEN, VOCAB, write_mds
from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]
DAEMONS = ("munged", "slurmctld", "slurmd")


def daemon_path(name: str) -> str | None:
    return shutil.which(name) or next(
        (p for p in (f"/usr/sbin/{name}", f"/sbin/{name}") if os.path.exists(p)), None
    )


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    missing = [d for d in (*DAEMONS, "sbatch", "squeue", "sinfo") if not daemon_path(d)]
    if missing:
        pytest.skip(
            f"Slurm not installed ({', '.join(missing)} missing): apt-get install slurm-wlm munge"
        )
    if os.geteuid() != 0:
        pytest.skip("a one-machine Slurm cluster needs root to run slurmd")
    root = tmp_path_factory.mktemp("slurm")
    for sub in ("state", "spool", "munge", "log"):
        (root / sub).mkdir()
    (root / "munge").chmod(0o700)
    key = root / "munge" / "munge.key"
    key.write_bytes(os.urandom(128))
    key.chmod(0o600)
    host = socket.gethostname()
    socket_path = root / "munge" / "munge.socket"
    conf = root / "slurm.conf"
    conf.write_text(
        f"""ClusterName=llmfoundry-test
SlurmctldHost={host}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={socket_path}
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
NodeName={host} CPUs={os.cpu_count()} RealMemory=1000 State=UNKNOWN
PartitionName=test Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""
    )
    env = {**os.environ, "SLURM_CONF": str(conf)}
    pid_files = [root / "munge" / "munged.pid", root / "slurmctld.pid", root / "slurmd.pid"]
    commands = [
        [
            daemon_path("munged"),
            f"--socket={socket_path}",
            f"--key-file={key}",
            f"--pid-file={pid_files[0]}",
            f"--log-file={root}/munge/munged.log",
            f"--seed-file={root}/munge/seed",
            "--force",
        ],
        [daemon_path("slurmctld"), "-f", str(conf)],
        [daemon_path("slurmd"), "-f", str(conf)],
    ]
    try:
        for command in commands:
            result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=30)
            if result.returncode:
                pytest.skip(f"{Path(command[0]).name} did not start: {result.stderr.strip()[:200]}")
            time.sleep(0.5)
        deadline = time.monotonic() + 30
        while (
            "idle"
            not in subprocess.run(
                ["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True, timeout=10
            ).stdout
        ):
            if time.monotonic() > deadline:
                pytest.skip(f"the test Slurm node never became idle (logs in {root}/log)")
            time.sleep(0.5)
        yield env
    finally:
        subprocess.run(
            ["scancel", "--full", "--user=root"], env=env, capture_output=True, timeout=30
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and queued(env):
            time.sleep(0.5)
        # slurmd before slurmctld before munged (both need it to shut down cleanly); then any
        # process still running with this cluster's config (a slurmd child finishing a step).
        pids = [int(f.read_text().split()[0]) for f in reversed(pid_files) if f.exists()]
        for pid in pids + processes_using(conf):
            stop(pid)


def queued(env) -> bool:
    result = subprocess.run(["squeue", "-h"], env=env, capture_output=True, text=True, timeout=10)
    return bool(result.stdout.strip())


def processes_using(conf: Path) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and str(conf).encode() in (proc / "cmdline").read_bytes():
                found.append(int(proc.name))
        except OSError:
            pass
    return found


def stop(pid: int, timeout: float = 10.0) -> None:
    """SIGTERM, then SIGKILL if it is still there after `timeout` seconds."""
    try:
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        if Path(f"/proc/{pid}").exists():
            os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def submit(slurm_env, tmp_path, name, max_duration, extra=()):
    mds = write_mds(tmp_path / "mds", {"train": 32, "val": 8})
    train = [
        f"data.remote={mds}",
        f"model.vocab_size={VOCAB}",
        f"model.max_seq_len={SEQ_LEN}",
        "model.d_model=64",
        "model.n_heads=2",
        "model.n_layers=2",
        "global_train_batch_size=4",
        f"max_duration={max_duration}",
        "eval_interval=100ba",
        "eval_subset_num_batches=2",
        "scheduler.t_warmup=1ba",
        "callbacks=[]",
        "loggers=[console,jsonl]",
        *extra,
    ]
    env = {**slurm_env, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts/launch.py"),
            "submit",
            "slurm",
            str(ROOT / "conf/job/tiny.yaml"),
            f"name={name}",
            f"outputs={tmp_path / 'outputs'}",
            "--out",
            str(tmp_path / "rendered"),
            *(f"--train={o}" for o in train),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    job_id = result.stderr.split("submitted Slurm job ")[1].split()[0]
    return job_id, tmp_path / "outputs" / name


def wait_gone(env, job_id, timeout):
    deadline = time.monotonic() + timeout
    while subprocess.run(
        ["squeue", "-h", "-j", job_id], env=env, capture_output=True, text=True, timeout=10
    ).stdout.strip():
        assert time.monotonic() < deadline, f"Slurm job {job_id} still queued after {timeout}s"
        time.sleep(1)


def status(folder):
    return json.loads((folder / "status.json").read_text())


@pytest.mark.slow
def test_sbatch_runs_torchrun_with_c10d_rendezvous(slurm, tmp_path):
    job_id, folder = submit(slurm, tmp_path, "slurm-real", "4ba")
    wait_gone(slurm, job_id, 180)
    log = (folder / f"slurm-{job_id}.log").read_text()
    assert status(folder)["status"] == "finished", log[-3000:]
    assert status(folder)["world_size"] == 2
    assert (folder / "checkpoints" / "latest").read_text().strip() == "ep0-ba4"


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("LLMFOUNDRY_SLURM_REQUEUE_TEST") != "1",
    reason="Slurm holds a requeued job ~2 minutes; set LLMFOUNDRY_SLURM_REQUEUE_TEST=1 to run",
)
def test_preempted_job_is_requeued_and_resumes(slurm, tmp_path):
    job_id, folder = submit(
        slurm, tmp_path, "slurm-preempt", "300ba", ["++callbacks.run_status.interval_s=0.2"]
    )
    deadline = time.monotonic() + 120
    while True:
        assert time.monotonic() < deadline, "the run never reached batch 20"
        try:
            if status(folder)["step"] >= 20:
                break
        except (FileNotFoundError, json.JSONDecodeError, KeyError):
            pass
        time.sleep(0.5)
    subprocess.run(["scancel", "--signal=TERM", job_id], env=slurm, check=True, timeout=30)
    wait_gone(slurm, job_id, 400)
    log = (folder / f"slurm-{job_id}.log").read_text()
    assert f"requeueing job {job_id}" in log, log[-3000:]
    assert "loaded checkpoint" in log
    assert status(folder)["status"] == "finished" and status(folder)["step"] == 300


@pytest.mark.slow
def test_submitit_launcher_runs_sweep_trials_as_slurm_jobs(slurm, tmp_path):
    """The README's hydra/launcher=submitit_slurm: each trial a Slurm job, its own run."""
    pytest.importorskip(
        "hydra_plugins.hydra_submitit_launcher", reason="pip install 'llmfoundry[sweep]'"
    )
    mds = write_mds(tmp_path / "mds", {"train": 32, "val": 8})
    env = {**slurm, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts/train.py"),
            "-m",
            "hydra/launcher=submitit_slurm",
            "hydra.launcher.timeout_min=10",
            "hydra.launcher.cpus_per_task=1",
            "hydra.launcher.mem_gb=0",
            "optimizer.lr=1e-3,3e-3",
            f"data.remote={mds}",
            f"model.vocab_size={VOCAB}",
            f"model.max_seq_len={SEQ_LEN}",
            "model.d_model=64",
            "model.n_heads=2",
            "model.n_layers=2",
            "global_train_batch_size=4",
            "max_duration=2ba",
            "eval_interval=2ba",
            "eval_subset_num_batches=2",
            "callbacks=[run_status]",
            "loggers=[jsonl]",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (sweep,) = (tmp_path / "outputs").glob("sweep-*")
    assert (sweep / ".submitit").is_dir()
    names = {
        status(sweep / str(n))["run_name"]
        for n in range(2)
        if status(sweep / str(n))["status"] == "finished"
    }
    assert names == {f"{sweep.name}/0", f"{sweep.name}/1"}

"""`scripts/runs.py describe|stop NAME`: one run's details, and stopping it on its backend."""

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from llmfoundry.launch import load_job
from llmfoundry.launch.backends import kubernetes_objects, submit_local
from llmfoundry.utils.status_file import KUBERNETES_JOB_ENV, write_status
from tests.launch.test_status import _runs_script

ROOT = Path(__file__).resolve().parents[2]


def _run(root: Path, name: str, status: str = "running", **fields) -> Path:
    folder = root / name
    record = {"run_name": name, "status": status, "step": 40, "total_steps": 300, "loss": 2.5}
    record.update(updated=time.time(), host=socket.gethostname(), pid=1, started=time.time())
    record.update(fields)
    write_status(str(folder / "status.json"), record)
    return folder


def _main(argv, capsys):
    """(exit status, stdout, stderr) of scripts/runs.py; a one-line error exits 2."""
    try:
        code = _runs_script()(argv)
    except SystemExit as exited:
        code = exited.code
    out, err = capsys.readouterr()
    return code, out, err


def test_stop_a_local_run_signals_its_rank_0(tmp_path, capsys):
    worker = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        _run(tmp_path, "mine", pid=worker.pid, backend="local")
        code, _, err = _main(["stop", "mine", str(tmp_path)], capsys)
        assert code == 2 and "confirm with --yes" in err and err.count("\n") == 1
        assert worker.poll() is None  # not stopped without the confirmation
        code, out, _ = _main(["stop", "mine", str(tmp_path), "--yes"], capsys)
        assert code == 0 and "sent SIGTERM to process" in out
        assert worker.wait(timeout=10) == -signal.SIGTERM
    finally:
        worker.kill()
        worker.wait()
    # Now its process is gone: a one-line error, as for a finished or an unknown run.
    code, _, err = _main(["stop", "mine", str(tmp_path), "--yes"], capsys)
    assert code == 2 and "mine is killed: nothing to stop" in err and err.count("\n") == 1
    _run(tmp_path, "done", status="finished", pid=os.getpid())
    code, _, err = _main(["stop", "done", str(tmp_path), "--yes"], capsys)
    assert code == 2 and "done is finished: nothing to stop" in err
    code, _, err = _main(["stop", "nope", str(tmp_path), "--yes"], capsys)
    assert code == 2 and "no run named 'nope'" in err and err.count("\n") == 1


def test_stop_a_slurm_run_cancels_its_job_and_refuses_a_forged_id(tmp_path, capsys, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    (bin_dir / "scancel").write_text(f'#!/bin/bash\necho "$@" >> {calls}\n')
    (bin_dir / "scancel").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    runs = tmp_path / "runs"
    # Requeued after preemption, the job is still Slurm's: stopping it cancels it.
    _run(runs, "big", status="preempted", backend="slurm", job_id="4242", host="node-7")
    _run(runs, "forged", backend="slurm", job_id="4242 --user=alice")
    code, out, _ = _main(["stop", "big", str(runs), "--yes"], capsys)
    assert code == 0 and "cancelled Slurm job 4242" in out
    assert calls.read_text() == "4242\n"
    code, _, err = _main(["stop", "forged", str(runs), "--yes"], capsys)
    assert code == 2 and "is not a slurm job id" in err
    assert calls.read_text() == "4242\n"


def test_stop_a_kubernetes_run_deletes_its_job_and_service(tmp_path, capsys, monkeypatch):
    kubernetes = pytest.importorskip("kubernetes")
    deleted = []

    class Api:
        def delete_namespaced_job(self, name, namespace, propagation_policy):
            deleted.append(("Job", namespace, name, propagation_policy))

        def delete_namespaced_service(self, name, namespace):
            deleted.append(("Service", namespace, name))

    monkeypatch.setattr(kubernetes.config, "load_incluster_config", lambda: None)
    monkeypatch.setattr(kubernetes.client, "BatchV1Api", Api)
    monkeypatch.setattr(kubernetes.client, "CoreV1Api", Api)
    # The manifest tells the pods their Job, which the status file records.
    job = load_job(ROOT / "conf/job/mpt-1b.yaml", ["kubernetes.namespace=ml"])
    pod = kubernetes_objects(job)[0][1]["spec"]["template"]["spec"]["containers"][0]
    assert {"name": KUBERNETES_JOB_ENV, "value": "ml/mpt-1b"} in pod["env"]
    _run(tmp_path, "mpt-1b", backend="kubernetes", job_id="ml/mpt-1b", host="mpt-1b-0")
    code, out, _ = _main(["stop", "mpt-1b", str(tmp_path), "--yes"], capsys)
    assert code == 0 and "deleted Job and Service mpt-1b in namespace ml" in out
    assert deleted == [("Job", "ml", "mpt-1b", "Background"), ("Service", "ml", "mpt-1b")]


def test_describe_shows_status_backend_config_and_last_metrics(tmp_path, capsys):
    folder = _run(tmp_path, "big", backend="slurm", job_id="4242", host="node-7", pid=77)
    (folder / ".hydra").mkdir()
    (folder / ".hydra/config.yaml").write_text(
        "max_duration: 300ba\noptimizer: {lr: 0.0002}\n"
        "data: {remote: 's3://bob:hunter2@store/mds'}\n"
    )
    lines = [
        {"time": 1.0, "hyperparameters": {}},
        {"step": 30, "time": 2.0, "metrics": {"loss/train": 2.75}},
        {"step": 40, "time": 3.0, "metrics": {"loss/train": 2.5, "lr": 1e-4}},
    ]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    code, out, _ = _main(["describe", "big", str(tmp_path)], capsys)
    assert code == 0
    shown = {line.split("  ")[0]: line.split("  ", 1)[1].strip() for line in out.splitlines()}
    assert shown["status"] == "running" and shown["step"] == "40/300"
    assert shown["backend"] == "slurm job 4242 (rank 0: pid 77 on node-7)"
    assert shown["folder"] == str(folder)
    assert shown["config max_duration"] == "300ba" and shown["config optimizer.lr"] == "0.0002"
    assert "hunter2" not in out and "<redacted>" in shown["config data.remote"]
    assert shown["metrics (step 40)"] == "loss/train=2.5, lr=0.0001"


def test_submit_local_detach_returns_at_once_with_the_run_in_its_own_session(tmp_path, capsys):
    """--detach: the script runs on in a session of its own (a closed terminal or Ctrl-C in
    it does not reach it), its output in the run folder's launch.log."""
    job = load_job(ROOT / "conf/job/tiny.yaml", ["name=bg", f"outputs={tmp_path / 'out'}"])
    script = tmp_path / "bg.sh"
    gate = tmp_path / "gate"
    script.write_text(
        f'echo "pid $$ session $(ps -o sid= -p $$)"\nwhile [ ! -e {gate} ]; do sleep 0.05; done\necho done\n'
    )
    assert submit_local(script, job, ROOT, detach=True) == 0
    out = capsys.readouterr().out
    assert "python scripts/runs.py logs bg " in out and "python scripts/runs.py stop bg " in out
    log = tmp_path / "out/bg/launch.log"
    deadline = time.monotonic() + 60
    while "session" not in log.read_text():
        assert time.monotonic() < deadline, "the detached script wrote nothing"
        time.sleep(0.05)
    pid, session = (int(w) for w in log.read_text().split()[1::2])
    assert session == pid != os.getsid(0)  # its own session: the submitter returned before it ended
    gate.touch()
    while "done" not in log.read_text():
        assert time.monotonic() < deadline, "the detached script did not finish"
        time.sleep(0.05)


def test_describe_of_hostile_files_is_bounded_printable_text(tmp_path, capsys):
    """Status, config and metrics are written by others: escapes are shown, not acted on, long
    values cut, a broken config or metrics line does not hide the rest."""
    folder = _run(tmp_path, "odd", run_name="odd\x1b[2J", host="elsewhere")
    (folder / ".hydra").mkdir()
    (folder / ".hydra/config.yaml").write_text("max_duration: [unclosed\n")
    big = {"\x1b]0;pwned\x07": 2.0, "x" * 5000: 1.0}
    lines = [json.dumps({"step": "many", "metrics": big}), "[" * 20_000, "not json"]
    (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    code, out, _ = _main(["describe", "odd", str(tmp_path)], capsys)
    assert code == 0 and "\x1b" not in out and "\\x1b" in out
    assert max(len(line) for line in out.splitlines()) < 500
    assert "config" in out and "unreadable" in out and "metrics (step ?)" in out

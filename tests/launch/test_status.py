"""The run status file (RunStatus callback), the outcome check and the runs listing."""

import contextlib
import json
import math
import os
import runpy
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import fsspec
import pytest
import yaml

from llmfoundry.callbacks import RunStatus
from llmfoundry.launch.command import RESUME_EXIT
from llmfoundry.launch.monitor import find_run, find_runs, follow, log_file, table
from llmfoundry.launch.outcome import outcome
from llmfoundry.trainer import Callback
from llmfoundry.utils.errors import MissingInput
from llmfoundry.utils.status_file import read_status, write_status
from tests.callbacks.conftest import make_trainer


class At(Callback):
    """Does `action` at the end of batch `batch`."""

    def __init__(self, batch, action):
        self.batch, self.action = batch, action

    def batch_end(self, state, logger):
        if state.timestamp.batch == self.batch:
            self.action(state)


def status_after(tmp_path, *callbacks, raises=None, **kwargs):
    trainer = make_trainer(tmp_path, n_batches=6, callbacks=[RunStatus(), *callbacks], **kwargs)
    if raises:
        with pytest.raises(raises):
            trainer.fit()
    else:
        trainer.fit()
    return json.loads((tmp_path / "status.json").read_text())


def test_finished_run(tmp_path):
    status = status_after(tmp_path, config={"run_name": "r1", "save_folder": "ckpt"})
    assert status["status"] == "finished"
    assert (status["run_name"], status["step"], status["total_steps"]) == ("r1", 6, 6)
    assert status["save_folder"] == os.path.abspath("ckpt")
    assert status["loss"] > 0 and status["tokens_per_sec"] > 0 and status["eta_s"] == 0.0


def test_early_stopped_run_is_finished(tmp_path):
    status = status_after(tmp_path, At(2, lambda s: setattr(s, "stop_training", True)))
    assert (status["status"], status["step"]) == ("finished", 2)


def test_preempted_run(tmp_path):
    status = status_after(tmp_path, At(3, lambda s: os.kill(os.getpid(), signal.SIGTERM)))
    assert (status["status"], status["step"]) == ("preempted", 3)


def test_failed_run_records_the_error(tmp_path):
    def crash(state):
        raise RuntimeError("disk on fire")

    status = status_after(tmp_path, At(2, crash), raises=RuntimeError)
    assert (status["status"], status["step"]) == ("failed", 2)
    assert status["error"] == "RuntimeError: disk on fire"


def test_a_failure_naming_a_url_with_credentials_records_it_redacted(tmp_path):
    def crash(state):
        raise OSError("cannot reach https://bob:hunter2@store.example/ckpt")

    status = status_after(tmp_path, At(2, crash), raises=OSError)
    assert status["error"] == "OSError: cannot reach https://<redacted>@store.example/ckpt"


def test_heartbeat_while_running(tmp_path):
    seen = []

    def look(state):
        seen.append(read_status(str(tmp_path / "status.json")))

    make_trainer(tmp_path, n_batches=4, callbacks=[RunStatus(interval_s=1e-9), At(3, look)]).fit()
    assert seen[0]["status"] == "running" and seen[0]["step"] == 3
    assert seen[0]["eta_s"] > 0 and seen[0]["total_steps"] == 4


def test_outcome_exit_codes(tmp_path):
    path = str(tmp_path / "status.json")
    assert outcome(path) == 1  # no status at all: the run never started
    assert outcome(path, exit_code=3) == 3
    for status, code in [
        ("finished", 0),
        ("preempted", RESUME_EXIT),
        ("failed", 1),
        ("running", 1),
    ]:
        write_status(path, {"status": status})
        assert outcome(path) == code
        # torchrun's exit status does not override what the run recorded.
        assert outcome(path, exit_code=1 if code == 0 else 0) == code
    # A node whose torchrun returned first waits for rank 0 to record the end.
    write_status(path, {"status": "running"})
    timer = threading.Timer(0.3, write_status, (path, {"status": "finished"}))
    timer.start()
    assert outcome(path, wait_s=10, poll_s=0.05) == 0
    timer.join()


@pytest.fixture
def runs():
    """Runs in an fsspec in-memory filesystem: listing works on URLs, not only folders."""
    fs = fsspec.filesystem("memory")
    root = "memory://runs-test"
    now = time.time()
    write_status(
        f"{root}/a/status.json",
        {
            "run_name": "a",
            "status": "running",
            "step": 50,
            "total_steps": 300,
            "loss": 3.25,
            "tokens_per_sec": 12345.0,
            "eta_s": 125.0,
            "updated": now,
            "save_folder": f"{root}/a/checkpoints",
        },
    )
    fs.pipe(f"{root}/a/checkpoints/latest", b"ep0-ba50")
    fs.pipe(f"{root}/a/launch.log", b"line 1\nline 2\n")
    write_status(
        f"{root}/sweep-x/0/status.json",
        {
            "run_name": "sweep-x/0",
            "status": "finished",
            "step": 6,
            "total_steps": 6,
            "updated": now - 60,
        },
    )
    write_status(
        f"{root}/old/status.json",
        {"run_name": "old", "status": "running", "step": 7, "updated": now - 7200},
    )
    yield root
    fs.rm(root.removeprefix("memory://"), recursive=True)


def test_runs_listing(runs):
    listed = {run.name: run for run in find_runs(runs)}
    assert set(listed) == {"a", "sweep-x/0", "old"}
    assert listed["a"].checkpoint == "ep0-ba50"
    assert listed["sweep-x/0"].status == "finished"
    assert listed["old"].status == "failed" and "no heartbeat for 2h00m" in listed["old"].note
    text = table(list(listed.values())).splitlines()
    assert text[0].split() == [
        "NAME",
        "STATUS",
        "STEP",
        "LOSS",
        "TOKENS/S",
        "ETA",
        "CHECKPOINT",
        "UPDATED",
        "NOTE",
    ]
    row = next(line for line in text if line.startswith("a "))
    assert row.split()[:7] == ["a", "running", "50/300", "3.2500", "12,345", "2m05s", "ep0-ba50"]


def test_logs_follow_until_the_run_ends(runs):
    run = find_run(runs, "a")
    path = log_file(run)
    assert path.endswith("/a/launch.log")
    chunks = []

    def later():
        time.sleep(0.3)
        fsspec.filesystem("memory").pipe(
            path.removeprefix("memory://"), b"line 1\nline 2\nline 3\n"
        )
        write_status(f"{run.folder}/status.json", {"status": "finished"})

    thread = threading.Thread(target=later)
    thread.start()
    for chunk in follow(path, f"{run.folder}/status.json", poll_s=0.05):
        chunks.append(chunk)
    thread.join()
    assert b"".join(chunks) == b"line 1\nline 2\nline 3\n"
    with pytest.raises(MissingInput, match="no run named 'nope'"):
        find_run(runs, "nope")


def _runs_script():
    """The `main` of scripts/runs.py, called in this process."""
    return runpy.run_path(str(Path(__file__).resolve().parents[2] / "scripts/runs.py"))["main"]


def _local_run(root: Path, name: str, save_folder: str | None, storage: dict | None = None):
    """A run folder as scripts/train.py leaves it: status.json, its saved config, its log."""
    folder = root / name
    (folder / ".hydra").mkdir(parents=True)
    config = {"run_name": name, "save_folder": save_folder, "storage": storage}
    (folder / ".hydra/config.yaml").write_text(yaml.safe_dump(config))
    (folder / "train.log").write_text(f"{name} log\n")
    record = {"run_name": name, "status": "finished", "step": 2, "total_steps": 2}
    write_status(str(folder / "status.json"), {**record, "save_folder": save_folder})
    return folder


def test_runs_on_an_s3_compatible_store_use_the_storage_settings_they_saved(
    s3_endpoint, monkeypatch, tmp_path, capsys
):
    # Credentials in the environment, as a user has them; the endpoint only in each run's config.
    for key, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    s3 = fsspec.filesystem("s3", endpoint_url=s3_endpoint, skip_instance_cache=True)
    s3.mkdir("runs-on-s3")
    s3.pipe("runs-on-s3/s3run/checkpoints/latest", b"ep0-ba2")
    outputs = tmp_path / "outputs"
    _local_run(
        outputs,
        "s3run",
        "s3://runs-on-s3/s3run/checkpoints",
        {"options": {"endpoint_url": s3_endpoint, "profile": None}, "overrides": {}},
    )
    _local_run(outputs, "local", str(tmp_path / "ckpt"))
    # A profile this machine lacks: its status is listed, its checkpoints are not readable.
    _local_run(
        outputs,
        "elsewhere",
        "s3://runs-on-s3/elsewhere/checkpoints",
        {"options": {"endpoint_url": s3_endpoint, "profile": "no-such-profile"}},
    )
    (_local_run(outputs, "sweep-b/0", None) / "status.json").write_text("{not json")

    runs = _runs_script()
    assert runs([str(outputs)]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:]}
    assert set(lines) == {"s3run", "local", "elsewhere", "sweep-b/0"}
    assert lines["s3run"].split()[:3] == ["s3run", "finished", "2/2"]
    assert "ep0-ba2" in lines["s3run"]
    assert lines["local"].split()[:3] == ["local", "finished", "2/2"]
    assert lines["elsewhere"].split()[:2] == ["elsewhere", "finished"]
    assert "checkpoints unreadable: ProfileNotFound" in lines["elsewhere"]
    assert lines["sweep-b/0"].split()[:2] == ["sweep-b/0", "unreadable"]
    assert "JSONDecodeError" in lines["sweep-b/0"]

    # logs of a local run are not stopped by the other runs' stores.
    assert runs(["logs", "local", str(outputs), "-f"]) == 0
    assert capsys.readouterr().out == "local log\n"

    # Runs under the bucket itself: --storage reaches the root URL.
    s3.pipe("runs-on-s3/remote/status.json", b'{"run_name": "remote", "status": "preempted"}')
    listing = ["s3://runs-on-s3", "--storage", f"{{options: {{endpoint_url: {s3_endpoint}}}}}"]
    assert runs(listing) == 0
    assert capsys.readouterr().out.splitlines()[1].split()[:2] == ["remote", "preempted"]


def test_a_bad_storage_setting_is_one_line_and_exit_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as exited:
        _runs_script()([str(tmp_path), "--storage", "{options: ["])
    assert exited.value.code == 2
    assert capsys.readouterr().err.startswith("error: --storage '{options: [': not a YAML/JSON")


def test_a_root_of_save_folders_says_where_the_runs_are(tmp_path, capsys):
    """`runs.py <the save folders' URL>` names the checkpoints it found instead of only 'no runs'."""
    (tmp_path / "runs/mine/ep0-ba2").mkdir(parents=True)
    (tmp_path / "runs/mine/latest").write_text("ep0-ba2")
    assert _runs_script()([str(tmp_path / "runs")]) == 0
    out = capsys.readouterr().out
    assert f"checkpoints in {tmp_path / 'runs/mine'}" in out and "outputs folder" in out
    (tmp_path / "empty").mkdir()
    assert _runs_script()([str(tmp_path / "empty")]) == 0
    assert capsys.readouterr().out.strip() == f"no runs under {tmp_path / 'empty'}"


def test_a_diverged_runs_status_records_its_nan_loss(tmp_path):
    """JSON has no NaN: the strict writer raised at the first heartbeat after the loss went NaN,
    which ended the run (and left its status at running)."""
    make_trainer(tmp_path, n_batches=2, lr=1e30, callbacks=[RunStatus(interval_s=1e-9)]).fit()
    status = json.loads((tmp_path / "status.json").read_text())
    assert status["status"] == "finished" and status["loss"] == "nan"
    assert math.isnan(read_status(str(tmp_path / "status.json"))["loss"])


@contextlib.contextmanager
def within(seconds: int):
    """Fail instead of hanging (a reader blocked on a FIFO)."""

    def timeout(signum, frame):
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, timeout)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


ESCAPES = "\x1b]0;pwned\x07\x1b[2J\r\u202e"


def _hostile_runs(root: Path, outside: Path) -> dict[str, str]:
    """Run folders holding status files no run writes, by folder name, with the note each gets."""
    (outside / "notes.txt").write_text("not json, and not the lister's business")
    (outside / "ckpt").mkdir()
    (outside / "ckpt/latest").symlink_to("/dev/zero")
    cases = {
        "huge": (b" " * (1 << 20) + b"{}", "is larger than 65,536 bytes"),
        "deep": (b"[" * 30_000 + b"]" * 30_000, "JSON nested too deeply"),
        "latin1": (b'{"run_name": "caf\xe9"}', "not UTF-8 (byte 17)"),
        "nan": (b'{"status": "running", "updated": NaN}', "NaN in a status file"),
        "inf": (b'{"status": "running", "updated": 1e999}', "updated is inf, not a finite"),
        "loss-text": (b'{"status": "running", "loss": "low"}', "loss is 'low', not a number"),
        "step-dict": (
            b'{"status": "running", "step": {"a": 1}}',
            "step is {'a': 1}, not an integer",
        ),
        "a-list": (b"[1, 2]", "a JSON list, not a status record"),
    }
    for name, (data, _) in cases.items():
        (root / name).mkdir()
        (root / name / "status.json").write_bytes(data)
    for name, target in {
        "fifo": None,
        "zero": "/dev/zero",
        "outside": outside / "notes.txt",
    }.items():
        (root / name).mkdir()
        if target is None:
            os.mkfifo(root / name / "status.json")
        else:
            (root / name / "status.json").symlink_to(target)
    notes = {name: note for name, (_, note) in cases.items()}
    notes |= {"fifo": "is not a regular file", "zero": "is not a regular file"}
    notes["outside"] = "JSONDecodeError: Expecting value"
    # Valid records whose strings and numbers a terminal or a clock cannot take as they are.
    write_status(
        str(root / "escapes/status.json"),
        {"run_name": f"x{ESCAPES}y", "status": "failed", "error": f"boom{ESCAPES}", "step": 1},
    )
    write_status(
        str(root / "long/status.json"),
        {"run_name": "n" * 10_000, "status": "running", "updated": 1e300, "eta_s": 1e300},
    )
    write_status(
        str(root / "pointer/status.json"),
        {"run_name": "pointer", "status": "finished", "save_folder": str(outside / "ckpt")},
    )
    return notes


def test_runs_lists_hostile_status_files_one_line_each_without_hanging(tmp_path, capsys):
    """Anyone who can write the runs folder writes status files: each bad one is one listed run
    with a note, read no further than a status file can be long, and nothing reaches the
    terminal as an escape sequence (old: a FIFO hung the listing, /dev/zero filled memory, a
    wrong type or a huge clock ended it with a traceback, escapes were printed as they are)."""
    root, outside = tmp_path / "outputs", tmp_path / "elsewhere"
    root.mkdir(), outside.mkdir()
    notes = _hostile_runs(root, outside)
    _local_run(root, "good", None)
    with within(60):
        assert _runs_script()([str(root)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\r" not in out and "\u202e" not in out and "\x07" not in out
    lines = out.splitlines()[1:]
    assert len(lines) == len(notes) + 4 and max(map(len, lines)) < 400
    rows = {line.split()[0]: line for line in lines}
    assert rows["good"].split()[:3] == ["good", "finished", "2/2"]
    for name, note in notes.items():
        assert rows[name].split()[1] == "unreadable" and note in rows[name], rows[name]
    escaped = next(line for line in lines if line.startswith("x\\x1b]0;pwned\\x07"))
    assert "boom\\x1b]0;pwned" in escaped and "\\u202e" in escaped
    long = next(line for line in lines if line.startswith("nnnn"))
    assert "..." in long and "running" in long
    assert rows["pointer"].split()[:3] == ["pointer", "finished", "-"]
    assert "checkpoints unreadable" in rows["pointer"] and "not a regular file" in rows["pointer"]
    with within(60), pytest.raises(SystemExit):  # an error naming the runs: one line, escaped
        _runs_script()(["logs", "nope", str(root)])
    err = capsys.readouterr().err
    assert err.startswith("error: no run named 'nope'") and "x\\x1b]0;pwned" in err
    assert err.count("\n") == 1 and "\x1b" not in err


def test_outcome_of_a_status_file_that_is_not_one_is_the_exit_code(tmp_path, caplog):
    """The node script's outcome check: a broken status file is a failure with a reason, not a
    traceback (nor a hang on a FIFO)."""
    os.mkfifo(tmp_path / "status.json")
    with within(30):
        assert outcome(str(tmp_path / "status.json"), exit_code=3) == 3
    assert "is not a regular file" in caplog.text


def test_a_sweep_trial_with_a_broken_status_file_is_listed_as_unreadable(tmp_path):
    from llmfoundry.launch.sweeps import trials

    for number, status in (("0", b'{"status": "finished"}'), ("1", b'{"status": ["x"]}')):
        (tmp_path / number / ".hydra").mkdir(parents=True)
        (tmp_path / number / ".hydra/overrides.yaml").write_text(f"- optimizer.lr={number}\n")
        (tmp_path / number / "status.json").write_bytes(status)
    assert [t.status for t in trials(tmp_path)] == ["finished", "unreadable"]


def _running(folder: Path, **fields) -> None:
    record = {"run_name": folder.name, "status": "running", "step": 5, "total_steps": 300}
    record.update(updated=time.time(), eta_s=600.0, host=socket.gethostname())
    record.update(fields)
    write_status(str(folder / "status.json"), record)


def test_a_run_whose_process_is_gone_from_this_host_is_killed_at_once(tmp_path):
    """kill -9 leaves the status at running: the pid on this host tells, without waiting for
    the heartbeat to go stale. A pid now held by a later process is not the run's either."""
    sleeper = subprocess.Popen(["sleep", "60"])
    sleeper.kill()
    sleeper.wait()
    _running(tmp_path / "gone", pid=sleeper.pid, started=time.time() - 5)
    later = subprocess.Popen(["sleep", "60"])
    try:
        _running(tmp_path / "reused", pid=later.pid, started=time.time() - 100)
        _running(tmp_path / "alive", pid=os.getpid(), started=time.time())
        _running(tmp_path / "elsewhere", pid=sleeper.pid, started=0.0, host="another-node")
        listed = {run.name: run for run in find_runs(str(tmp_path))}
    finally:
        later.kill()
        later.wait()
    for name in ("gone", "reused"):
        assert listed[name].status == "killed" and listed[name].eta_s is None, name
        assert "on this host ended without a word" in listed[name].note
    # Following its log ends too, rather than waiting for a heartbeat that never comes.
    (tmp_path / "gone/launch.log").write_text("last words\n")
    with within(30):
        chunks = list(follow(str(tmp_path / "gone/launch.log"), str(tmp_path / "gone/status.json")))
    assert chunks == [b"last words\n"]
    assert (listed["alive"].status, listed["alive"].eta_s) == ("running", 600.0)
    assert listed["elsewhere"].status == "running"


def test_a_run_without_a_status_file_is_listed_with_the_hint(tmp_path, capsys):
    """A run folder without run_status (its saved config shows it is one) is not left out."""
    (tmp_path / "quiet/.hydra").mkdir(parents=True)
    (tmp_path / "quiet/.hydra/config.yaml").write_text("run_name: quiet\n")
    _local_run(tmp_path, "loud", None)
    assert _runs_script()([str(tmp_path)]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("quiet"))
    assert row.split()[1] == "unknown" and "add run_status to callbacks=" in row


def test_the_status_records_the_backend_and_job_id_that_stop_acts_on(tmp_path, monkeypatch):
    monkeypatch.delenv("LLMFOUNDRY_KUBERNETES_JOB", raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    status = status_after(tmp_path / "slurm")
    assert (status["backend"], status["job_id"]) == ("slurm", "4242")
    monkeypatch.delenv("SLURM_JOB_ID")
    status = status_after(tmp_path / "local")
    assert (status["backend"], status["pid"]) == ("local", os.getpid())
    assert "job_id" not in status

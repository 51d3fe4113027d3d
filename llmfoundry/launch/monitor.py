"""Where runs stand, from their status files: the table `scripts/runs.py` prints, and following
one run's log.

A run is a folder holding ``status.json`` (`llmfoundry.callbacks.run_status`), found up to two
levels below the root given (``outputs/<run>`` and a sweep's ``outputs/<sweep>/<n>``), on a
local disk or any fsspec URL (``s3://bucket/runs``). The status says running / finished /
preempted / failed; a ``running`` status whose heartbeat is older than `stale_s` is reported as
failed (the process was killed without a word: SIGKILL, lost node), and one written on this host
by a process that is gone (or whose pid another, later process has now) as ``killed`` at once.
The last checkpoint is what ``<save_folder>/latest`` names. A run folder without a status file
(a run without the ``run_status`` callback: its saved ``.hydra/config.yaml`` shows it) is listed
as ``unknown``, with a hint to add the callback.

A run's checkpoints may be on another store than its folder (``outputs/<run>`` on this disk,
``save_folder=s3://...`` on MinIO): each run is read with the storage settings it saved
(``storage:`` of its ``.hydra/config.yaml``) beneath this process's own (``--storage``), so a
listing needs no endpoint in the environment. A run that still cannot be read (credentials,
an endpoint down, a broken file) is listed as ``unreadable`` with the reason, beside the others.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import fsspec
from omegaconf import OmegaConf

from llmfoundry.checkpoint import read_latest
from llmfoundry.config.run_files import CONFIG_DIR
from llmfoundry.utils import storage
from llmfoundry.utils.errors import MissingInput, UserError, printable
from llmfoundry.utils.secrets import redact_urls
from llmfoundry.utils.status_file import read_status
from llmfoundry.utils.storage import url_to_fs
from llmfoundry.utils.yaml_guard import safe_load

# Seconds without a heartbeat after which a "running" run is taken for dead.
STALE_S = 900.0
# Log files of a run folder, most specific first: the launcher's, Slurm's, Hydra's job log.
LOG_PATTERNS = ("launch.log", "slurm-*.log", "*.log")
# A saved config is a few KB; a file far larger is not one (read no further).
MAX_CONFIG_BYTES = 1 << 20
# Bytes of a log read at once while following it (a log may be gigabytes).
LOG_CHUNK_BYTES = 1 << 20
# Characters shown of one table cell (a name or note from a status file can be any length).
MAX_CELL = 80


@dataclass
class Run:
    name: str
    folder: str  # URL or path of the run folder
    status: str
    step: int | None = None
    total_steps: int | None = None
    loss: float | None = None
    tokens_per_sec: float | None = None
    eta_s: float | None = None
    checkpoint: str | None = None
    updated: float | None = None
    note: str = ""
    record: dict[str, Any] = field(default_factory=dict)  # the status file's, as read


def find_runs(root: str, stale_s: float = STALE_S, now: float | None = None) -> list[Run]:
    """Every run under `root` (a folder or URL), newest update first."""
    fs, path = url_to_fs(root)
    if not fs.exists(path):
        raise MissingInput(f"{root} does not exist: pass the outputs folder or its URL")
    protocol = root.split("://", 1)[0] + "://" if "://" in root else ""
    base = path.rstrip("/")
    files = fs.glob(f"{base}/*/status.json") + fs.glob(f"{base}/*/*/status.json")
    folders = [f.rsplit("/", 1)[0] for f in files]
    runs = [_read_run(protocol + f, f[len(base) :].strip("/"), stale_s, now) for f in folders]
    configs = fs.glob(f"{base}/*/{CONFIG_DIR}/config.yaml")
    configs += fs.glob(f"{base}/*/*/{CONFIG_DIR}/config.yaml")
    silent = sorted({c.rsplit("/", 2)[0] for c in configs} - set(folders))
    runs += [_run_without_status(protocol + f, f[len(base) :].strip("/")) for f in silent]
    return sorted(runs, key=lambda r: -(r.updated or 0))


def _run_without_status(folder: str, name: str) -> Run:
    """A run folder holding a saved config but no status file: a run without the run_status
    callback (or one that never reached the start of training). Listed, not left out."""
    return Run(
        name=name,
        folder=folder,
        status="unknown",
        note="no status.json: still starting, or add run_status to callbacks= (a default)",
    )


def save_folders_without_runs(root: str) -> list[str]:
    """Save folders (a ``latest`` file) up to two levels below `root`: checkpoints of runs whose
    run folder, with its status, is elsewhere (``save_folder=s3://...`` beside local outputs)."""
    fs, path = url_to_fs(root)
    protocol = root.split("://", 1)[0] + "://" if "://" in root else ""
    base = path.rstrip("/")
    found = fs.glob(f"{base}/*/latest") + fs.glob(f"{base}/*/*/latest")
    return sorted(protocol + f.rsplit("/", 1)[0] for f in found)


def saved_storage(folder: str) -> dict[str, Any] | None:
    """The ``storage:`` block of the run's saved config (resolved), or None without one."""
    try:
        path = f"{folder}/{CONFIG_DIR}/config.yaml"
        config = safe_load(storage.read_small(path, MAX_CONFIG_BYTES), path)
    except FileNotFoundError:
        return None
    if not isinstance(config, dict) or not config.get("storage"):
        return None
    block = OmegaConf.create(config).storage
    return OmegaConf.to_container(block, resolve=True) if block is not None else None


def _read_run(folder: str, name: str, stale_s: float, now: float | None) -> Run:
    """The run in `folder`, read with its own storage settings; unreadable with the reason (and
    `name`, its folder under the root, as a sweep's trials are named: ``sweep-x/0``)."""
    try:
        with storage.falling_back_to(saved_storage(folder)):
            return _run(folder, f"{folder}/status.json", stale_s, now)
    except Exception as err:  # noqa: BLE001 - one run's store or file must not hide the others
        reason = (str(err).splitlines() or [""])[0]
        kind = "" if isinstance(err, UserError) else f"{type(err).__name__}: "
        return Run(
            name=name,
            folder=folder,
            status="unreadable",
            note=redact_urls(f"{kind}{reason}"),
        )


def _run(folder: str, status_file: str, stale_s: float, now: float | None) -> Run:
    record: dict[str, Any] = read_status(status_file) or {}
    status, note = record.get("status", "unknown"), record.get("error", "")
    updated = record.get("updated")
    now = time.time() if now is None else now
    if status == "running" and updated is not None and now - updated > stale_s:
        status = "failed"
        note = f"no heartbeat for {format_seconds(now - updated)} (killed?)"
    elif status == "running" and process_gone(record):
        status = "killed"
        note = (
            f"process {record['pid']} on this host ended without a word (kill -9? out of memory?)"
        )
    checkpoint = None
    if record.get("save_folder"):
        try:
            checkpoint = read_latest(record["save_folder"])
        except Exception as err:  # noqa: BLE001 - the status itself was read: keep it listed
            checkpoint = "?"
            first_line = (str(err).splitlines() or [""])[0]
            note = note or redact_urls(
                f"checkpoints unreadable: {type(err).__name__}: {first_line}"
            )
    return Run(
        name=record.get("run_name") or folder.rsplit("/", 1)[-1],
        folder=folder,
        status=status,
        step=record.get("step"),
        total_steps=record.get("total_steps"),
        loss=record.get("loss"),
        tokens_per_sec=record.get("tokens_per_sec"),
        eta_s=record.get("eta_s") if status == "running" else None,
        checkpoint=checkpoint,
        updated=updated,
        note=note,
        record=record,
    )


def process_gone(record: dict[str, Any]) -> bool:
    """Whether the process that wrote `record` ran on this host and no longer runs the run: its
    pid is gone, a zombie, or (Linux) held by a process started after the run started."""
    pid = record.get("pid")
    if record.get("host") != socket.gethostname() or not isinstance(pid, int) or pid <= 0:
        return False  # (pid 0 and negative ones name process groups: never signalled)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # another user's process: it exists
        pass
    except (OverflowError, OSError):  # no such pid can exist
        return True
    stat = process_stat(pid)
    if stat is None:
        return False
    state, start = stat
    started = record.get("started")
    # The record's start is taken after the process began: a later process reused the pid.
    return state == "Z" or (started is not None and start > started + 2.0)


def process_stat(pid: int) -> tuple[str, float] | None:
    """(state letter, start time in seconds since the epoch) of `pid`, from Linux's /proc; None
    elsewhere or when it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as stat_file:
            fields = stat_file.read().rsplit(")", 1)[1].split()
        with open("/proc/stat") as system:
            boot = next(float(line.split()[1]) for line in system if line.startswith("btime "))
        return fields[0], boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError, StopIteration):
        return None


def format_seconds(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if not 0 <= seconds < 1e7:  # (a status file's ETA may be anything)
        return "?"
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"


def table(runs: list[Run]) -> str:
    """The runs as an aligned text table, like `mcli get runs`.

    Every cell is shown as printable text of at most `MAX_CELL` characters (the note: twice
    that): names and notes come from status files, which anyone who can write the runs folder
    writes, and the table goes to a terminal."""
    header = ("NAME", "STATUS", "STEP", "LOSS", "TOKENS/S", "ETA", "CHECKPOINT", "UPDATED", "NOTE")
    rows = [header]
    for run in runs:
        step = "-" if run.step is None else f"{run.step}/{run.total_steps or '?'}"
        cells = (
            run.name,
            run.status,
            step,
            "-" if run.loss is None else f"{run.loss:.4f}",
            "-" if run.tokens_per_sec is None else f"{run.tokens_per_sec:,.0f}",
            format_seconds(run.eta_s),
            run.checkpoint or "-",
            _clock(run.updated),
        )
        rows.append((*(_cell(c, MAX_CELL) for c in cells), _cell(run.note, 2 * MAX_CELL)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )


def _cell(text: str, width: int) -> str:
    shown = printable(text)
    return shown if len(shown) <= width else f"{shown[: width - 3]}..."


def _clock(stamp: float | None) -> str:
    """`stamp` (seconds since the epoch) as month-day hour:minute, '?' if no clock has it."""
    if stamp is None:
        return "-"
    try:
        return time.strftime("%m-%d %H:%M", time.localtime(stamp))
    except (OverflowError, OSError, ValueError):
        return "?"


def find_run(root: str, name: str) -> Run:
    runs = find_runs(root)
    matches = [r for r in runs if name in (r.name, r.folder.rsplit("/", 1)[-1])]
    if not matches:
        known = ", ".join(_cell(r.name, MAX_CELL) for r in runs[:10]) or "none"
        known += f" and {len(runs) - 10} more" if len(runs) > 10 else ""
        raise MissingInput(f"no run named {name!r} under {root} (runs: {known})")
    return matches[0]


def log_file(run: Run) -> str:
    """The run's log: the newest file of the first pattern in LOG_PATTERNS that matches."""
    fs, path = url_to_fs(run.folder)
    for pattern in LOG_PATTERNS:
        found = fs.glob(f"{path.rstrip('/')}/{pattern}")
        if found:
            newest = max(found, key=lambda f: _modified(fs, f))
            protocol = run.folder.split("://", 1)[0] + "://" if "://" in run.folder else ""
            return protocol + newest
    raise MissingInput(
        f"run {run.name} has no log file in {run.folder} (looked for {', '.join(LOG_PATTERNS)})"
    )


def _modified(fs: fsspec.AbstractFileSystem, path: str) -> float:
    """Modification time in seconds: local files give a number, object stores a datetime."""
    info = fs.info(path)
    stamp = info.get("mtime") or info.get("LastModified") or info.get("created") or 0
    return stamp.timestamp() if hasattr(stamp, "timestamp") else float(stamp)


def follow(path: str, status_file: str | None, poll_s: float = 1.0) -> Iterator[bytes]:
    """The file's bytes, then what is appended to it while the run is running (like tail -f).

    Stops once the run's status is no longer ``running`` (or its process is gone from this
    host) and nothing new was written.
    """
    fs, local = url_to_fs(path)
    offset = 0
    while True:
        size = fs.size(local)
        if size > offset:
            end = min(size, offset + LOG_CHUNK_BYTES)
            yield fs.cat_file(local, start=offset, end=end)
            offset = end
            continue
        try:
            record = read_status(status_file) if status_file else None
        except ValueError:  # a status file broken since the listing: nothing says it runs
            record = None
        if not record or record.get("status") != "running" or process_gone(record):
            return
        time.sleep(poll_s)

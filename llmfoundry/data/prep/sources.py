"""Document sources for tokenization, split into small independent reading tasks.

A source is a folder of text files, a single text file, a ``.jsonl`` file, a ``.parquet``
file, a Hugging Face dataset saved with ``save_to_disk``, or ``hf:NAME`` (``datasets``'
``load_dataset``: local files, or the hub when online). :func:`plan_tasks` turns sources into
an ordered list of :class:`Task` s of a few MiB each, and :func:`read_task` reads one of them.
Tasks are planned from file metadata only (sizes, line offsets, row groups), so the main
process never holds the corpus, and workers read their own slices: memory stays bounded and
the document order is fixed by the plan, not by which worker finishes first.
"""

from __future__ import annotations

import fnmatch
import hashlib
import importlib
import json
import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmfoundry.utils.errors import MissingInput, MissingPackage, UserError

__all__ = ["Task", "fingerprint", "iter_documents", "plan_tasks", "read_task"]

TASK_BYTES = 4 << 20  # target text per task: large enough to amortise IPC, small for memory
JSONL_SUFFIXES = (".jsonl", ".ndjson")
HF_PREFIX = "hf:"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Task:
    """One slice of one source: ``kind`` says how to read ``location`` and ``part``."""

    kind: str  # "files" | "jsonl" | "parquet" | "hf"
    location: str  # file path, or the hf dataset spec
    part: tuple  # files: paths; jsonl: (start, end) bytes; parquet: (row_group,); hf: (start, stop)
    text_field: str = "text"


def _import(module: str, package: str) -> Any:
    """Import an optional dependency, naming the package to install when it is missing."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingPackage(
            f"this source needs {package}: pip install {package} (or pip install 'llmfoundry[data]')"
        ) from None


def _is_saved_hf_dataset(path: Path) -> bool:
    return path.is_dir() and (
        (path / "dataset_dict.json").is_file() or (path / "state.json").is_file()
    )


def _list_files(folder: Path, globs: Sequence[str], excludes: Sequence[str]) -> list[Path]:
    """Files under ``folder`` whose name matches a glob, minus excluded ones.

    An exclude pattern matches a file's name or relative path, or a directory's relative path
    (``test``, ``site-packages/*``), in which case the directory is not even walked.
    """

    def excluded_dir(rel: str) -> bool:
        return any(fnmatch.fnmatch(rel, e) or fnmatch.fnmatch(rel + "/", e) for e in excludes)

    found = []
    for root, dirs, files in os.walk(folder):
        rel_root = Path(root).relative_to(folder).as_posix()
        dirs[:] = sorted(
            d
            for d in dirs
            if not d.startswith(".")
            and not excluded_dir(d if rel_root == "." else f"{rel_root}/{d}")
        )
        for name in files:
            path = Path(root, name)
            rel = path.relative_to(folder).as_posix()
            if not any(fnmatch.fnmatch(name, g) for g in globs):
                continue
            if any(fnmatch.fnmatch(rel, e) or fnmatch.fnmatch(name, e) for e in excludes):
                continue
            if path.is_file():
                found.append(path)
    return sorted(found, key=lambda p: p.relative_to(folder).as_posix())


def _file_tasks(paths: list[Path], text_field: str) -> list[Task]:
    tasks, batch, size = [], [], 0
    for path in paths:
        batch.append(str(path))
        size += path.stat().st_size
        if size >= TASK_BYTES or len(batch) >= 1024:
            tasks.append(Task("files", "", tuple(batch), text_field))
            batch, size = [], 0
    if batch:
        tasks.append(Task("files", "", tuple(batch), text_field))
    return tasks


def _jsonl_tasks(path: Path, text_field: str) -> list[Task]:
    """Byte ranges of about TASK_BYTES, each starting at a line start."""
    size = path.stat().st_size
    tasks, start = [], 0
    with open(path, "rb") as f:
        while start < size:
            f.seek(min(start + TASK_BYTES, size))
            if f.tell() < size:
                f.readline()  # move to the next line start
            end = min(f.tell(), size)
            tasks.append(Task("jsonl", str(path), (start, end), text_field))
            start = end
    return tasks


def _parquet_tasks(path: Path, text_field: str) -> list[Task]:
    meta = _import("pyarrow.parquet", "pyarrow").ParquetFile(path)
    if text_field not in meta.schema_arrow.names:
        raise UserError(
            f"{path} has no column {text_field!r} (columns: {meta.schema_arrow.names}); "
            "choose one with --text-field"
        )
    kind = meta.schema_arrow.field(text_field).type
    if str(kind) not in ("string", "large_string", "string_view"):
        text_columns = [
            f.name for f in meta.schema_arrow if str(f.type) in ("string", "large_string")
        ]
        raise UserError(
            f"{path}: column {text_field!r} holds {kind}, not text; choose a text column with "
            f"--text-field (text columns: {text_columns})"
        )
    return [
        Task("parquet", str(path), (i,), text_field) for i in range(meta.metadata.num_row_groups)
    ]


def _load_hf(spec: str) -> Any:
    """Load the dataset a spec names: ``disk:PATH[:SPLIT]`` or ``hub:NAME[:CONFIG]:SPLIT``."""
    datasets = _import("datasets", "datasets")
    kind, _, rest = spec.partition(":")
    if kind == "disk":
        path, _, split = rest.rpartition("::")
        ds = datasets.load_from_disk(path)
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise UserError(f"{path} holds splits {sorted(ds)}; choose one with --hf-split")
            ds = ds[split]
        return ds
    name, config, split = json.loads(rest)
    try:
        return datasets.load_dataset(name, config, split=split)
    except Exception as err:  # the hub or a loader failed: say which dataset and why
        raise UserError(
            f"could not load Hugging Face dataset {name!r} (config {config}, split {split}): "
            f"{type(err).__name__}: {err}. Offline? Give a local path or a save_to_disk folder."
        ) from err


_HF_CACHE: dict[str, Any] = {}


def _hf_dataset(spec: str) -> Any:
    if spec not in _HF_CACHE:
        _HF_CACHE.clear()  # one dataset at a time per process
        _HF_CACHE[spec] = _load_hf(spec)
    return _HF_CACHE[spec]


def _hf_tasks(spec: str, text_field: str, rows_per_task: int = 2048) -> list[Task]:
    ds = _hf_dataset(spec)
    if text_field not in ds.column_names:
        raise UserError(
            f"dataset {spec} has no column {text_field!r} (columns: {ds.column_names}); "
            "choose one with --text-field"
        )
    n = len(ds)
    return [
        Task("hf", spec, (start, min(start + rows_per_task, n)), text_field)
        for start in range(0, n, rows_per_task)
    ]


def plan_tasks(
    sources: Sequence[str],
    globs: Sequence[str] = ("*.txt",),
    excludes: Sequence[str] = (),
    text_field: str = "text",
    hf_split: str = "train",
    hf_config: str | None = None,
) -> list[Task]:
    """Ordered reading tasks covering every source, in the order given."""
    if not sources:
        raise UserError("no sources given; pass folders, .jsonl/.parquet files or hf:NAME")
    tasks: list[Task] = []
    for source in sources:
        if source.startswith(HF_PREFIX):
            spec = "hub:" + json.dumps([source[len(HF_PREFIX) :], hf_config, hf_split])
            tasks += _hf_tasks(spec, text_field)
            continue
        path = Path(source)
        if not path.exists():
            raise MissingInput(f"source {source} does not exist")
        if _is_saved_hf_dataset(path):
            tasks += _hf_tasks(f"disk:{path}::{hf_split}", text_field)
        elif path.is_dir():
            files = _list_files(path, globs, excludes)
            if not files:
                raise UserError(
                    f"no files in {path} match --glob {list(globs)} "
                    f"(minus --exclude {list(excludes)})"
                )
            tasks += _file_tasks(files, text_field)
        elif path.suffix in JSONL_SUFFIXES:
            tasks += _jsonl_tasks(path, text_field)
        elif path.suffix == ".parquet":
            tasks += _parquet_tasks(path, text_field)
        else:
            tasks += _file_tasks([path], text_field)
    return tasks


def _text_of(obj: Any, field: str, where: str) -> str | None:
    """The text field of a row; None (a null) is skipped by the caller, as in parquet."""
    if not isinstance(obj, dict) or field not in obj:
        keys = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
        raise UserError(f"{where}: no field {field!r} (found {keys}); choose one with --text-field")
    text = obj[field]
    if text is not None and not isinstance(text, str):
        raise UserError(
            f"{where}: field {field!r} is {type(text).__name__}, not text; choose a text field "
            "with --text-field"
        )
    return text


def read_task(task: Task) -> tuple[list[str], int]:
    """The documents of one task, and how many were skipped.

    Skipped: text files that are not UTF-8 (each named in the log), and null texts of any row
    source (parquet, JSONL, datasets) alike. A JSONL line that is not UTF-8 or not JSON is an
    error naming the file and the line's byte offset.
    """
    if task.kind == "files":
        docs, skipped = [], 0
        for name in task.part:
            try:
                docs.append(Path(name).read_bytes().decode("utf-8"))
            except UnicodeDecodeError as err:
                log.warning("skipping %s: not UTF-8 text (%s)", name, err.reason)
                skipped += 1
        return docs, skipped
    if task.kind == "jsonl":
        start, end = task.part
        with open(task.location, "rb") as f:
            f.seek(start)
            block = f.read(end - start)
        docs, pos, skipped = [], start, 0
        for line in block.split(b"\n"):
            where = f"{task.location} (line at byte {pos})"
            pos += len(line) + 1
            if not line.strip():
                continue
            try:
                obj = json.loads(line.decode("utf-8"))
            except UnicodeDecodeError as err:
                raise UserError(
                    f"{where}: not UTF-8 ({err.reason} at byte {pos - len(line) - 1 + err.start}); "
                    "convert the file to UTF-8, e.g. iconv -f latin1 -t utf-8"
                ) from None
            except json.JSONDecodeError as err:
                raise UserError(f"{where}: invalid JSON: {err}; fix or remove the line") from None
            text = _text_of(obj, task.text_field, where)
            if text is None:
                skipped += 1
            else:
                docs.append(text)
        return docs, skipped
    if task.kind == "parquet":
        table = (
            _import("pyarrow.parquet", "pyarrow")
            .ParquetFile(task.location)
            .read_row_group(task.part[0], columns=[task.text_field])
        )
        values = table.column(task.text_field).to_pylist()
        docs = [v for v in values if v is not None]
        return docs, len(values) - len(docs)
    if task.kind == "hf":
        start, stop = task.part
        values = _hf_dataset(task.location)[start:stop][task.text_field]
        docs = [v for v in values if v is not None]
        return docs, len(values) - len(docs)
    raise ValueError(f"unknown task kind {task.kind!r}")


def iter_documents(tasks: Sequence[Task]) -> Iterator[str]:
    """Every document of ``tasks`` in order, one task in memory at a time."""
    for task in tasks:
        yield from read_task(task)[0]


def _local_files(task: Task) -> list[str]:
    """The local files a task reads (a hub dataset's files are remote: none)."""
    if task.kind == "files":
        return list(task.part)
    if task.kind != "hf":
        return [task.location]
    if task.location.startswith("disk:"):
        folder = Path(task.location[len("disk:") :].rpartition("::")[0])
    else:
        folder = Path(json.loads(task.location[len("hub:") :])[0])
    return sorted(str(p) for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else []


def fingerprint(tasks: Sequence[Task]) -> str:
    """Hash of what the tasks would read: paths, sizes, modification times and slices.

    Cheap (no file contents) and changes when any input file changes, so reruns over the same
    inputs can be recognised and skipped.
    """
    h = hashlib.sha256()
    seen: set[str] = set()
    for task in tasks:
        h.update(json.dumps([task.kind, task.location, list(task.part), task.text_field]).encode())
        if task.kind == "hf" and task.location in seen:
            continue  # every task of one dataset reads the same files
        seen.add(task.location)
        for name in _local_files(task):
            if name not in seen and os.path.exists(name):
                seen.add(name)
                st = os.stat(name)
                h.update(f"{name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()

"""Checkpoint folders on any filesystem fsspec reaches: a local path, s3://, gs://, memory://.

A save folder holds checkpoints and a pointer to the newest complete one::

    <save_folder>/latest            one line: the name of the newest complete checkpoint
    <save_folder>/ep0-ba200/        a checkpoint, named by the epoch and batch it was taken at
        model.safetensors           model weights (written by rank 0), or
        sharded/                    model and optimizer shards of every rank (sharded.py)
        state.pt                    the rest of the run (rank 0; contents: state_dict.py)
        rng-rank<r>.pt              each rank's random generator states
        manifest.json               size and SHA-256 of every file above (manifest.py), last

A checkpoint is complete when its manifest is there and lists files that are all there: the
manifest is written after every file of every rank, so a save killed half-way never makes a
checkpoint that counts. On a local disk each rank writes into its own scratch folder, whose files
move into a hidden staging folder that is renamed into place with its manifest; on an object
store the files are uploaded into the checkpoint's folder and the manifest goes last. `latest`
is then replaced in one step (a rename on a local disk, a single PUT on an object store). It is
a shortcut: when it is missing (deleted, or lost in a partial copy between buckets) or names a
checkpoint that is not complete, `find_checkpoint` scans the folder for the newest complete
checkpoint. What killed saves leave (staging and scratch folders, incomplete checkpoints newer
than the newest complete one, temporary `latest` files) is removed by `clean` before a run's
first save and after each save.

Files are only ever read back as tensors and plain containers: safetensors for weights and
``torch.load(weights_only=True)`` for the rest, and sharded/ through dcp_reader.py (DCP's metadata
with an unpickler that admits only DCP's classes), and DeepSpeed's shards with
``weights_only=True`` too (llmfoundry/checkpoint/deepspeed.py), so a checkpoint cannot run code
when loaded; each file is checked against the manifest before it is parsed.
"""

from __future__ import annotations

import contextlib
import errno
import io
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec
import safetensors.torch
import torch
import torch.distributed as dist
from fsspec.implementations.local import LocalFileSystem

from llmfoundry.checkpoint.manifest import (
    MANIFEST,
    CheckpointError,
    Entries,
    check_bytes,
    check_file,
    describe,
    hash_tree,
    manifest_bytes,
    missing_files,
    read_manifest,
)
from llmfoundry.utils import storage
from llmfoundry.utils.errors import MissingInput, UserError
from llmfoundry.utils.files import FileWriter, atomic_write, fsync_path, join_url

log = logging.getLogger(__name__)

LATEST = "latest"
MODEL_FILE = "model.safetensors"
STATE_FILE = "state.pt"
HF_CONFIG = "config.json"  # what a transformers folder has and a checkpoint has not
SHARDED_DIR = "sharded"
# Checkpoint names; also what `latest` may contain, so a pointer can never lead outside the folder.
_NAME = re.compile(r"^ep(\d+)-ba(\d+)$")
# What a killed save leaves: staging and scratch folders, temporary `latest` files, probes.
_TMP_PREFIX = "llmfoundry-ckpt-"  # local scratch folders of saves to object stores
_LITTER = re.compile(r"^(\.ep\d+-ba\d+\.(staging|old|rank\d+)|latest\.tmp[.-].*|\.write-probe-.*)$")


def rng_file(rank: int) -> str:
    return f"rng-rank{rank}.pt"


def checkpoint_name(epoch: int, batch: int) -> str:
    return f"ep{epoch}-ba{batch}"


def write_tensors(tensors: Mapping[str, torch.Tensor]) -> FileWriter:
    """A writer of a safetensors file (tensors must not share memory). Whoever saves weights
    refuses non-finite ones first, on every rank at once (llmfoundry/checkpoint/finite.py)."""
    return lambda path: safetensors.torch.save_file(dict(tensors), str(path))


def write_object(obj: Any) -> FileWriter:
    """A writer of tensors in plain containers, readable with ``weights_only=True``."""
    return lambda path: torch.save(obj, path)


def write_checkpoint(folder: str, name: str, files: Mapping[str, FileWriter]) -> str:
    """Write this rank's `files` as checkpoint `name` in `folder`, then point `latest` at it.

    Every rank calls this with its own files (rank 0 the shared ones, each rank its RNG; a
    writer may write a folder, e.g. shards); ranks synchronize through torch.distributed when it
    is initialized. Each rank hashes what it wrote, rank 0 writes the manifest of all of it and
    then `latest`. Returns the checkpoint's URL.
    """
    return begin_checkpoint(folder, name, files).finish()


def begin_checkpoint(folder: str, name: str, files: Mapping[str, FileWriter]) -> PendingCheckpoint:
    """Start `write_checkpoint`: run this rank's writers, of which one may return a Future (a
    write going on in the background: async DCP shards). Nothing of it counts until `finish`,
    which every rank calls at the same point of the run."""
    if not _NAME.match(name):
        raise ValueError(f"checkpoint name {name!r} must look like 'ep<epoch>-ba<batch>'")
    pending = PendingCheckpoint(folder, name)
    with pending.cleanup_on_error():
        if pending.rank == 0:  # a folder of this name left by an earlier attempt must not mix in
            if pending.local:
                shutil.rmtree(pending.staging, ignore_errors=True)
                pending.staging.mkdir(parents=True)
            elif pending.fs.exists(pending.target):
                pending.fs.rm(pending.target, recursive=True)
        _barrier()  # (and after rank 0's pruning of the last save, which cleans scratch folders)
        pending.make_scratch()
        for filename, write in files.items():
            result = write(pending.scratch / filename)
            if isinstance(result, Future):
                pending.background.append(result)
    return pending


class PendingCheckpoint:
    """A checkpoint this rank has begun writing (`begin_checkpoint`); `finish` makes it count."""

    def __init__(self, folder: str, name: str) -> None:
        self.folder, self.name = folder, name
        self.fs, self.root = storage.url_to_fs(folder)
        self.target = join_url(self.root, name)
        self.rank = dist.get_rank() if _distributed() else 0
        self.local = isinstance(self.fs, LocalFileSystem)
        self.staging = Path(self.root) / f".{name}.staging"
        self.background: list[Future] = []
        # This rank's files go here first (`make_scratch`): in a local save folder (`clean`
        # removes it if the run dies), else in a local temporary folder that `finish` uploads.
        self.scratch: Path | None = (
            Path(self.root) / f".{name}.rank{self.rank}" if self.local else None
        )

    def make_scratch(self) -> None:
        if self.scratch is None:
            self.scratch = Path(tempfile.mkdtemp(prefix=_TMP_PREFIX))
            return
        shutil.rmtree(self.scratch, ignore_errors=True)
        self.scratch.mkdir(parents=True)

    def finish(self) -> str:
        """Wait for the background writes, then make the checkpoint count: move (or upload)
        every rank's files, write the manifest, then `latest`. Returns the checkpoint's URL."""
        with self.cleanup_on_error():
            for future in self.background:
                future.result()
            entries = hash_tree(self.scratch)
            for relative in entries:
                if self.local:
                    (self.staging / relative).parent.mkdir(parents=True, exist_ok=True)
                    os.replace(self.scratch / relative, self.staging / relative)
                else:
                    self.fs.put_file(str(self.scratch / relative), join_url(self.target, relative))
            shutil.rmtree(self.scratch, ignore_errors=True)
            entries = _gather(entries)
            if self.rank == 0:
                if self.local:
                    (self.staging / MANIFEST).write_bytes(manifest_bytes(entries))
                    _fsync_tree(self.staging)  # on disk before any name points at it
                    _replace_folder(self.staging, Path(self.target))
                else:
                    self.fs.pipe_file(join_url(self.target, MANIFEST), manifest_bytes(entries))
                _write_latest(self.fs, self.root, self.name)
        _barrier()
        return join_url(self.folder, self.name)

    def abandon(self) -> None:
        """Wait for the background writes (their errors no longer matter) and remove this
        rank's scratch folder, without making the checkpoint count."""
        for future in self.background:
            if future.exception() is not None:
                log.warning("abandoned checkpoint %s: %s", self.name, future.exception())
        shutil.rmtree(self.scratch, ignore_errors=True)

    @contextlib.contextmanager
    def cleanup_on_error(self) -> Iterator[None]:
        """A save that fails leaves no scratch or staging folder; a full disk is one line."""
        with _disk_full_is_one_line(self.folder):
            try:
                yield
            except BaseException:
                if self.scratch is not None:
                    shutil.rmtree(self.scratch, ignore_errors=True)
                if self.local and self.rank == 0:
                    shutil.rmtree(self.staging, ignore_errors=True)
                raise


@contextlib.contextmanager
def _disk_full_is_one_line(folder: str) -> Iterator[None]:
    try:
        yield
    except OSError as err:
        if err.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        where = str(err.filename or folder)
        fix = (  # checkpoints for object stores are written to a local temporary folder first
            "set TMPDIR to a disk with room"
            if _TMP_PREFIX in where
            else "free space there (num_checkpoints_to_keep keeps fewer) or set save_folder to "
            "a disk with room"
        )
        raise CheckpointError(
            f"no space left on the device writing {where}: the checkpoint was not saved and "
            f"'{LATEST}' still names the previous one; {fix}, then rerun with autoresume=true"
        ) from None


def _gather(entries: Entries) -> Entries:
    """Every rank's manifest entries, merged (on every rank)."""
    if not _distributed():
        return entries
    gathered: list[Entries | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, entries)
    return {k: v for part in gathered for k, v in (part or {}).items()}


def _fsync_tree(folder: Path) -> None:
    for directory, _, files in os.walk(folder):
        for name in files:
            fsync_path(Path(directory) / name)
        fsync_path(directory)


def _replace_folder(staging: Path, target: Path) -> None:
    """Move a finished staging folder to `target`, replacing an older copy of the same name."""
    if not target.exists():
        os.replace(staging, target)
        return
    old = target.with_name(f".{target.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    os.replace(target, old)
    os.replace(staging, target)
    shutil.rmtree(old)


def _write_latest(fs: fsspec.AbstractFileSystem, root: str, name: str) -> None:
    path = join_url(root, LATEST)
    if isinstance(fs, LocalFileSystem):
        atomic_write(path, name + "\n")
    else:
        fs.pipe_file(path, (name + "\n").encode())


def read_latest(folder: str) -> str | None:
    """The checkpoint `latest` names in a save folder, or None when there is no `latest`.

    Read no further than a name can be long (`storage.read_small`): `scripts/runs.py` reads
    the save folders that status files name, which may be anyone's."""
    try:
        name = storage.read_small(join_url(folder, LATEST), 4096).decode("utf-8", "replace")
    except FileNotFoundError:
        return None
    name = name.strip()
    if not _NAME.match(name):
        raise UserError(
            f"{folder}/{LATEST} contains {name[:80]!r}, not a checkpoint name like 'ep0-ba100'; "
            "fix or delete the file"
        )
    return name


def latest_checkpoint(folder: str) -> str | None:
    """URL of the checkpoint to continue from in `folder` (`find_checkpoint`), or None."""
    name = find_checkpoint(folder)
    return None if name is None else join_url(folder, name)


def checkpoint_names(folder: str) -> list[str]:
    """Names of the checkpoint folders in `folder`, complete or not, oldest first."""
    fs, root = storage.url_to_fs(folder)
    if not fs.isdir(root):
        return []
    names = [p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)]
    return sorted((n for n in names if _NAME.match(n)), key=_batch_epoch)


def is_complete(folder: str, name: str) -> bool:
    """Whether checkpoint `name` has a manifest and every file it lists (no file is read)."""
    fs, root = storage.url_to_fs(join_url(folder, name))
    try:
        files = read_manifest(fs, root)
    except CheckpointError:
        return False
    return files is not None and not missing_files(fs, root, files)


def find_checkpoint(folder: str) -> str | None:
    """The checkpoint to continue from: the one `latest` names if it is complete, else the
    newest complete one found by scanning the folder; None if there is none."""
    try:
        pointer = read_latest(folder)
    except ValueError as err:
        log.warning("%s; looking for the newest complete checkpoint instead", err)
        pointer = None
    if pointer is not None and is_complete(folder, pointer):
        return pointer
    name = newest_complete(folder)
    if name is not None:
        why = "is missing" if pointer is None else f"names {pointer}, which is incomplete"
        log.warning(
            "%s/%s %s; continuing from %s, the newest complete checkpoint found there",
            folder.rstrip("/"),
            LATEST,
            why,
            name,
        )
    return name


def newest_complete(folder: str) -> str | None:
    """The newest complete checkpoint of `folder` by batch, whatever `latest` says."""
    return next((n for n in reversed(checkpoint_names(folder)) if is_complete(folder, n)), None)


def clean(folder: str) -> list[str]:
    """Remove what killed saves left in `folder`: staging and scratch folders, temporary
    `latest` files, and incomplete checkpoints newer than the newest complete one (a save cut
    short; older incomplete ones, e.g. from a partial copy, are left alone). Call it only while
    no save is running (the run lock). Returns the names removed."""
    fs, root = storage.url_to_fs(folder)
    if not fs.isdir(root):
        return []
    removed = []
    for path in fs.ls(root, detail=False):
        name = path.rstrip("/").rsplit("/", 1)[-1]
        if _LITTER.match(name):
            fs.rm(path, recursive=True)
            removed.append(name)
    for name in reversed(checkpoint_names(folder)):  # newest first, down to a complete one
        if is_complete(folder, name):
            break
        fs.rm(join_url(root, name), recursive=True)
        removed.append(name)
    return removed


def prune(folder: str, keep: int) -> list[str]:
    """Keep the checkpoint `latest` names and the `keep - 1` before it (by batch); delete older.

    Checkpoints after `latest` are left alone: the future of a run resumed from an earlier
    point; the run's own save of that name replaces them. What killed saves left is removed
    (`clean`). ``keep < 1`` deletes no checkpoint. Returns the names of the deleted checkpoints.
    """
    clean(folder)
    latest = read_latest(folder)
    if keep < 1 or latest is None:
        return []
    fs, root = storage.url_to_fs(folder)
    names = checkpoint_names(folder)
    older = [n for n in names if _batch_epoch(n) < _batch_epoch(latest)]
    doomed = older[: max(0, len(older) - (keep - 1))]
    for name in doomed:
        fs.rm(join_url(root, name), recursive=True)
    return doomed


def delete_checkpoints(folder: str, names: list[str]) -> None:
    """Delete the checkpoints `names` of `folder` (those that exist)."""
    fs, root = storage.url_to_fs(folder)
    for name in names:
        if _NAME.match(name) and fs.exists(join_url(root, name)):
            fs.rm(join_url(root, name), recursive=True)


def probe_writable(folder: str) -> None:
    """A save folder that cannot be written fails in the first second of a run instead of at
    its first save (`storage.probe_writable`)."""
    storage.probe_writable(
        folder,
        "save_folder",
        "fix its permissions or the storage credentials/endpoint, or set save_folder to another "
        "folder",
        CheckpointError,
    )


def _batch_epoch(name: str) -> tuple[int, int]:
    epoch, batch = _NAME.match(name).groups()
    return int(batch), int(epoch)


@dataclass
class Checkpoint:
    """What one rank reads back: the weights (None in a sharded checkpoint, whose weights
    sharded.py loads), the run state, and its own RNG states if saved."""

    path: str
    model: dict[str, torch.Tensor] | None
    state: dict[str, Any]
    rng: dict[str, Any] | None


def resolve(path: str) -> str:
    """A checkpoint folder, or a save folder (its checkpoint to continue from) -> the checkpoint
    folder."""
    with _reading(path):
        fs, root = storage.url_to_fs(path)
        if fs.exists(join_url(root, STATE_FILE)) or fs.exists(join_url(root, MANIFEST)):
            return path
        latest = latest_checkpoint(path) if fs.isdir(root) else None
    if latest is not None:
        return latest
    if damage := newest_damage(path):
        raise CheckpointError(
            f"load_path {path} holds no complete checkpoint: {damage}; copy that checkpoint "
            "again if it came from elsewhere, or point load_path at an earlier checkpoint folder"
        )
    if fs.exists(join_url(root, HF_CONFIG)):
        raise CheckpointError(
            f"load_path {path} is a transformers folder, not a llmfoundry checkpoint; convert it "
            f"first with `python scripts/import_hf.py {path} CKPT_DIR` and point load_path at CKPT_DIR"
        )
    raise MissingInput(
        f"load_path {path!r} is neither a checkpoint folder (with {MODEL_FILE} and "
        f"{STATE_FILE}) nor a save folder with a complete checkpoint; point it at a folder "
        "like <save_folder>/ep0-ba100 or at the save_folder itself"
    )


def newest_damage(folder: str) -> str | None:
    """When `folder` holds checkpoints but none is complete: its newest checkpoint's URL and
    what is wrong with it (for an error that names the file to fix); None otherwise."""
    names = checkpoint_names(folder)
    if not names or newest_complete(folder) is not None:
        return None
    url = join_url(folder, names[-1])
    fs, root = storage.url_to_fs(url)
    return f"its newest, {url}, {_damage(fs, root, read_manifest(fs, root))}"


def _damage(fs: fsspec.AbstractFileSystem, root: str, files: Entries | None) -> str | None:
    """What keeps the checkpoint folder `root` from loading, from its manifest `files` and a
    listing of it (no file is read), or None when every file is there."""
    if files is None:
        return (
            f"has no {MANIFEST}: its save was cut short, it was copied in part, or an llmfoundry "
            "older than manifests saved it"
        )
    # A sharded checkpoint keeps its weights in SHARDED_DIR (read by the strategy), not MODEL_FILE.
    sharded = any(name.startswith(f"{SHARDED_DIR}/") for name in files)
    required = (STATE_FILE,) if sharded else (MODEL_FILE, STATE_FILE)
    problems = missing_files(fs, root, files) + [
        f"{f} (missing)" for f in required if f not in files
    ]
    return f"is incomplete: {', '.join(problems[:4])}" if problems else None


def read_checkpoint(path: str, rank: int) -> Checkpoint:
    """Read the checkpoint at `path` (see `resolve`) for `rank`, never unpickling objects.

    Every file is checked against the manifest: those this rank reads as it reads them, the
    rest (other ranks' files) shared out between the ranks, so a corrupt file is named on load.
    """
    path = resolve(path)
    with _reading(path):
        fs, root = storage.url_to_fs(path)
        files = read_manifest(fs, root)
        if damage := _damage(fs, root, files):
            raise CheckpointError(
                f"checkpoint {path} {damage}; load an earlier checkpoint (or the save folder, "
                "which finds the newest complete one)"
            )
        own = [MODEL_FILE, STATE_FILE, rng_file(rank)]
        world = dist.get_world_size() if _distributed() else 1
        others = sorted(set(files) - set(own))
        for name in others[rank % world :: world]:
            check_file(fs, join_url(root, name), files[name])
        return Checkpoint(
            path=path,
            model=_load_tensors(fs, root, files) if MODEL_FILE in files else None,  # sharded
            state=_load_object(fs, root, STATE_FILE, files),
            rng=_load_object(fs, root, rng_file(rank), files) if rng_file(rank) in files else None,
        )


def read_state(path: str) -> dict[str, Any]:
    """The run state of the checkpoint at `path` (see `resolve`) alone, checked against its
    manifest: its recorded config without reading the weights."""
    path = resolve(path)
    with _reading(path):
        fs, root = storage.url_to_fs(path)
        files = read_manifest(fs, root)
        if files is None or STATE_FILE not in files:
            raise CheckpointError(
                f"checkpoint {path} {_damage(fs, root, files)}; load an earlier checkpoint"
            )
        return _load_object(fs, root, STATE_FILE, files)


def read_checkpoint_together(path: str, rank: int) -> Checkpoint:
    """`read_checkpoint` by every rank of a run at once (the trainer's load), failing on every
    rank when it fails on one. Each rank hashes only its share of the other ranks' files and
    reads its own RNG file, so a damaged file fails one rank: alone, it left the others waiting
    for it in the shards' load, to fail there with a peer's traceback ("Connection closed by
    peer") or wait out the process group's timeout. Every rank raises the first failing rank's
    one-line error instead (that rank its own exception)."""
    failure: Exception | None = None
    try:
        checkpoint = read_checkpoint(path, rank)
    except Exception as err:  # noqa: BLE001 - raised below, once the ranks know of it
        failure = err
    if _distributed():
        said: list[tuple[bool, str] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(said, None if failure is None else _said(failure))
        first = next(((r, m) for r, m in enumerate(said) if m is not None), None)
        if failure is None and first is not None:
            other, (user_error, message) = first
            if user_error:
                raise CheckpointError(message)
            raise RuntimeError(f"rank {other} failed to read the checkpoint at {path}: {message}")
    if failure is not None:
        raise failure
    return checkpoint


def _said(err: Exception) -> tuple[bool, str]:
    """What a rank tells the others of its failure: whether the user can fix it, and how."""
    return (True, str(err)) if isinstance(err, UserError) else (False, describe(err))


@contextlib.contextmanager
def _reading(url: str) -> Iterator[None]:
    """An object store or web server that does not answer is one line naming `url`."""
    try:
        yield
    except Exception as err:
        if storage.is_local(url) or not storage.is_unreachable(err):
            raise
        raise CheckpointError(
            f"cannot read the checkpoint at {url} ({describe(err)}); {storage.UNREACHABLE_FIX}"
        ) from None


def _verified(fs: fsspec.AbstractFileSystem, root: str, name: str, files: Entries) -> Any:
    """The file `name`, checked against its manifest entry: a local path, or (object stores,
    read once) a file object over its bytes."""
    path = join_url(root, name)
    if isinstance(fs, LocalFileSystem):
        check_file(fs, path, files[name])
        return path
    return io.BytesIO(check_bytes(fs.unstrip_protocol(path), fs.cat_file(path), files[name]))


def _load_tensors(fs: fsspec.AbstractFileSystem, root: str, files: Entries) -> dict:
    source = _verified(fs, root, MODEL_FILE, files)
    try:
        if isinstance(source, str):
            return safetensors.torch.load_file(source)
        return safetensors.torch.load(source.getvalue())
    except Exception as err:  # noqa: BLE001 - bytes the manifest vouches for that do not parse
        raise _unreadable(fs, join_url(root, MODEL_FILE), err) from None


def _load_object(fs: fsspec.AbstractFileSystem, root: str, name: str, files: Entries) -> Any:
    source = _verified(fs, root, name, files)
    try:
        return torch.load(source, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - bytes the manifest vouches for that do not parse
        raise _unreadable(fs, join_url(root, name), err) from None


def _unreadable(fs: fsspec.AbstractFileSystem, path: str, err: Exception) -> CheckpointError:
    return CheckpointError(
        f"cannot read {fs.unstrip_protocol(path)}: {describe(err)}; the file matches its "
        "checkpoint's manifest but is not what llmfoundry saves (tensors and plain containers): "
        "it was damaged before it was hashed, or holds objects that loading refuses to "
        "unpickle; load an earlier checkpoint"
    )


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _barrier() -> None:
    if _distributed():
        dist.barrier()

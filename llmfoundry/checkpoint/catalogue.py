"""Save folders: checkpoint names, the `latest` pointer, which checkpoints are complete, and
removing what killed saves left or what is no longer kept (the folder catalogue).

A save folder holds checkpoints and a pointer to the newest complete one::

    <save_folder>/latest            one line: the name of the newest complete checkpoint
    <save_folder>/ep0-ba200/        a checkpoint, named by the epoch and batch it was taken at
        model.safetensors           model weights (written by rank 0), or
        sharded/                    model and optimizer shards of every rank (sharded.py)
        state.pt                    the rest of the run (rank 0; contents: state_dict.py)
        rng-rank<r>.pt              each rank's random generator states
        manifest.json               size and SHA-256 of every file above (manifest.py), last

A checkpoint is complete when its manifest is there and lists files that are all there (how
writer.py makes that so). `latest` is a shortcut: when it is missing (deleted, or lost in a
partial copy between buckets) or names a checkpoint that is not complete, `find_checkpoint`
scans the folder for the newest complete checkpoint. What killed saves leave (staging and
scratch folders, incomplete checkpoints newer than the newest complete one, temporary `latest`
files) is removed by `clean` before a run's first save and after each save.
"""

from __future__ import annotations

import logging
import re

import fsspec

from llmfoundry.checkpoint.manifest import (
    MANIFEST,
    CheckpointError,
    Entries,
    missing_files,
    read_manifest,
)
from llmfoundry.utils import storage
from llmfoundry.utils.errors import UserError
from llmfoundry.utils.files import join_url

log = logging.getLogger(__name__)

LATEST = "latest"
MODEL_FILE = "model.safetensors"
STATE_FILE = "state.pt"
SHARDED_DIR = "sharded"
# Checkpoint names; also what `latest` may contain, so a pointer can never lead outside the folder.
CHECKPOINT_NAME = re.compile(r"^ep(\d+)-ba(\d+)$")
# What a killed save leaves: staging and scratch folders, temporary `latest` files, probes.
_LITTER = re.compile(r"^(\.ep\d+-ba\d+\.(staging|old|rank\d+)|latest\.tmp[.-].*|\.write-probe-.*)$")


def rng_file(rank: int) -> str:
    return f"rng-rank{rank}.pt"


def checkpoint_name(epoch: int, batch: int) -> str:
    return f"ep{epoch}-ba{batch}"


def read_latest(folder: str) -> str | None:
    """The checkpoint `latest` names in a save folder, or None when there is no `latest`.

    Read no further than a name can be long (`storage.read_small`): `scripts/runs.py` reads
    the save folders that status files name, which may be anyone's."""
    try:
        name = storage.read_small(join_url(folder, LATEST), 4096).decode("utf-8", "replace")
    except FileNotFoundError:
        return None
    name = name.strip()
    if not CHECKPOINT_NAME.match(name):
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
    return sorted((n for n in names if CHECKPOINT_NAME.match(n)), key=_batch_epoch)


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
        if CHECKPOINT_NAME.match(name) and fs.exists(join_url(root, name)):
            fs.rm(join_url(root, name), recursive=True)


def _batch_epoch(name: str) -> tuple[int, int]:
    epoch, batch = CHECKPOINT_NAME.match(name).groups()
    return int(batch), int(epoch)


def newest_damage(folder: str) -> str | None:
    """When `folder` holds checkpoints but none is complete: its newest checkpoint's URL and
    what is wrong with it (for an error that names the file to fix); None otherwise."""
    names = checkpoint_names(folder)
    if not names or newest_complete(folder) is not None:
        return None
    url = join_url(folder, names[-1])
    fs, root = storage.url_to_fs(url)
    return f"its newest, {url}, {damage(fs, root, read_manifest(fs, root))}"


def damage(fs: fsspec.AbstractFileSystem, root: str, files: Entries | None) -> str | None:
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

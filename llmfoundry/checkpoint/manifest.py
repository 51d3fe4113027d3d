"""A checkpoint's manifest: the size and SHA-256 of every file it holds, written last.

``manifest.json`` is what makes a checkpoint folder complete: it is written after every file of
every rank (one ``model.safetensors`` or a ``sharded/`` tree of any depth alike), so a folder
without one is a save that was cut short, and a listed file that is missing or of another size
means a partial copy. Loading hashes the bytes it reads and compares them with the manifest, so
a flipped byte in a weight file is an error naming that file instead of a run that silently
trains from corrupt weights::

    {"format": 1, "algorithm": "sha256",
     "files": {"model.safetensors": {"size": 1234, "sha256": "9f86..."}, ...}}
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import fsspec

from llmfoundry.utils.errors import UserError
from llmfoundry.utils.files import join_url

MANIFEST = "manifest.json"
FORMAT = 1
_CHUNK = 8 << 20

# Relative path ("sharded/__0_0.distcp") -> {"size": bytes, "sha256": hex digest}.
Entries = dict[str, dict[str, Any]]


class CheckpointError(UserError):
    """A checkpoint folder problem the user can fix; the message is one line naming the path."""


def describe(err: BaseException) -> str:
    """`err` in one line for a message about a file: its type and the first sentence that says
    what went wrong (torch's refusals to unpickle put theirs after a paragraph of advice)."""
    text = str(err)
    if text.startswith(_TORCH_REFUSAL):  # "<refusal>. <advice>\n\n<the reason>\n\n<docs>"
        text = text.split("\n\n", 1)[-1].split(_TORCH_REASON, 1)[-1]
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    first = lines[0].split(". ", 1)[0].removesuffix(".") if lines else ""
    return f"{type(err).__name__}: {first}" if first else type(err).__name__


# How torch.load(weights_only=True) refuses a file, and introduces some of its reasons.
_TORCH_REFUSAL = "Weights only load failed"
_TORCH_REASON = "WeightsUnpickler error:"


def hash_tree(folder: Path) -> Entries:
    """Size and SHA-256 of every file under `folder`, keyed by its path relative to it.

    Files are hashed in threads (hashlib releases the GIL), so a checkpoint's weight and
    optimizer files cost the time of the largest one.
    """
    paths = [Path(d) / name for d, _, files in os.walk(folder) for name in files]
    with ThreadPoolExecutor(max_workers=min(8, len(paths) or 1)) as pool:
        digests = list(pool.map(_sha256, paths))
    return {
        path.relative_to(folder).as_posix(): {"size": path.stat().st_size, "sha256": digest}
        for path, digest in zip(paths, digests, strict=True)
    }


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def manifest_bytes(entries: Mapping[str, Mapping[str, Any]]) -> bytes:
    return json.dumps(
        {"format": FORMAT, "algorithm": "sha256", "files": dict(sorted(entries.items()))},
        indent=1,
    ).encode()


def read_manifest(fs: fsspec.AbstractFileSystem, root: str) -> Entries | None:
    """The files a checkpoint folder's manifest lists, or None when it has no manifest."""
    path = join_url(root, MANIFEST)
    try:
        raw = fs.cat_file(path)
    except FileNotFoundError:
        return None
    try:
        manifest = json.loads(raw)
        files = manifest["files"]
        if manifest.get("algorithm") != "sha256" or not isinstance(files, dict):
            raise ValueError("unknown layout")
    except (ValueError, KeyError, TypeError) as err:
        raise CheckpointError(
            f"{fs.unstrip_protocol(path)} is not a checkpoint manifest ({err}); the checkpoint "
            "is damaged: load an earlier one"
        ) from None
    return files


def missing_files(fs: fsspec.AbstractFileSystem, root: str, files: Entries) -> list[str]:
    """Files the manifest lists that are absent or of another size (what a partial copy
    leaves), as "name (why)"; one listing of the folder, no file is read."""
    found = {
        path[len(root.rstrip("/")) + 1 :]: info.get("size")
        for path, info in fs.find(root, detail=True).items()
    }
    problems = []
    for name, entry in files.items():
        if name not in found:
            problems.append(f"{name} (missing)")
        elif found[name] is not None and found[name] != entry["size"]:
            problems.append(f"{name} ({found[name]} bytes, the manifest says {entry['size']})")
    return problems


def check_bytes(url: str, data: bytes, entry: Mapping[str, Any] | None) -> bytes:
    """`data` read from `url` if it matches its manifest entry; else CheckpointError naming it."""
    if entry is None:
        raise CheckpointError(
            f"{url} is not listed in its checkpoint's {MANIFEST}; the checkpoint is damaged: "
            "load an earlier one"
        )
    if len(data) != entry["size"] or hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise _corrupt(url)
    return data


def check_file(fs: fsspec.AbstractFileSystem, path: str, entry: Mapping[str, Any]) -> None:
    """Hash the file at `path` in chunks and compare it with its manifest entry."""
    digest, size = hashlib.sha256(), 0
    with fs.open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    if size != entry["size"] or digest.hexdigest() != entry["sha256"]:
        raise _corrupt(fs.unstrip_protocol(path))


def _corrupt(url: str) -> CheckpointError:
    return CheckpointError(
        f"{url} is corrupt: its size or SHA-256 does not match the checkpoint's {MANIFEST} "
        "(its bytes changed after it was saved); load an earlier checkpoint"
    )

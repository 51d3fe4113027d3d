"""Check and merge MDS datasets (local folders or fsspec URLs).

``verify_mds`` reads every shard the way a training run would (stored file size and hashes,
decompression, raw hashes, header, every sample decoded, token ids below the vocabulary) and
collects every problem instead of stopping at the first. ``merge_indexes`` writes one
index.json above split folders, with basenames prefixed by the sub-folder, in the exact
format mosaicml-streaming's ``merge_index`` writes.
"""

from __future__ import annotations

import json
import posixpath
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
from fsspec.implementations.local import LocalFileSystem

from llmfoundry.data.mds import (
    INDEX_NAME,
    NDArray,
    ShardCorruptError,
    ShardInfo,
    ShardReader,
    get_encoding,
    parse_index,
    unpack_shard,
)
from llmfoundry.data.meta import read_meta
from llmfoundry.utils import storage
from llmfoundry.utils.errors import MissingInput, OutputExists, UserError
from llmfoundry.utils.files import join_url

__all__ = ["IndexReport", "find_indexes", "merge_folders", "merge_indexes", "verify_mds"]

COPY_CHUNK = 8 << 20  # bytes per read while copying a shard


@dataclass
class IndexReport:
    """What verify found for one index.json."""

    index: str
    shards: int = 0
    samples: int = 0
    raw_bytes: int = 0
    stored_bytes: int = 0
    columns: dict[str, str] = field(default_factory=dict)
    compression: set[str] = field(default_factory=set)
    hashes: set[str] = field(default_factory=set)
    tokens: int = 0  # elements of integer ndarray columns
    max_token: int | None = None
    errors: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["compression"] = sorted(self.compression)
        d["hashes"] = sorted(self.hashes)
        return d


def _subfolders_with_index(fs: fsspec.AbstractFileSystem, root: str) -> list[str]:
    if not fs.exists(root):
        return []
    return sorted(
        Path(p).name
        for p in fs.ls(root, detail=False)
        if fs.isdir(p) and fs.exists(join_url(p, INDEX_NAME))
    )


def find_indexes(url: str) -> list[str]:
    """Relative folders holding an index.json: ``[""]`` for the root, else its sub-folders."""
    fs, root = storage.url_to_fs(url)
    if fs.exists(join_url(root, INDEX_NAME)):
        return [""]
    subs = _subfolders_with_index(fs, root)
    if not subs:
        raise MissingInput(f"no {INDEX_NAME} in {url} or its sub-folders; is this an MDS dataset?")
    return subs


def _check_tokens(values: np.ndarray, vocab_size: int | None, report: IndexReport, where: str):
    if values.dtype.kind not in "iu" or values.size == 0:
        return
    report.tokens += int(values.size)
    hi, lo = int(values.max()), int(values.min())
    report.max_token = hi if report.max_token is None else max(report.max_token, hi)
    if vocab_size is not None and (hi >= vocab_size or lo < 0):
        report.errors.append(
            f"{where}: token ids span [{lo}, {hi}], outside the vocabulary [0, {vocab_size})"
        )


def _verify_shard(
    raw_path: Path,
    info: ShardInfo,
    vocab_size: int | None,
    report: IndexReport,
    allow_unsafe: bool,
    name: str,
) -> None:
    """Decode every sample of a raw shard; ``name`` is how errors refer to the shard."""
    with ShardReader(raw_path, info, allow_unsafe=allow_unsafe) as reader:
        coders = [get_encoding(e, allow_unsafe) for e in info.column_encodings]
        fixed = all(c.size is not None for c in coders)
        for column, coder in zip(info.column_names, coders, strict=True):
            if fixed and isinstance(coder, NDArray):
                _check_tokens(reader.array(column), vocab_size, report, name)
        if fixed and all(isinstance(c, NDArray) for c in coders):
            return  # every value was checked through the whole-shard views
        for i in range(len(reader)):
            sample = reader.get(i)
            if not fixed:
                for value in sample.values():
                    if isinstance(value, np.ndarray):
                        _check_tokens(value, vocab_size, report, f"{name} sample {i}")


def verify_mds(
    url: str, vocab_size: int | None = None, allow_unsafe: bool = False
) -> list[IndexReport]:
    """Verify every shard of the dataset(s) at ``url``; problems land in ``report.errors``.

    ``vocab_size`` defaults to the one in ``<url>/meta.json`` (written by tokens_to_mds).
    """
    fs, root = storage.url_to_fs(url)
    local = isinstance(fs, LocalFileSystem)
    if vocab_size is None:
        vocab_size = (read_meta(url) or {}).get("vocab_size")
    reports = []
    for sub in find_indexes(url):
        folder = join_url(root, sub)
        index_url = join_url(folder, INDEX_NAME)
        report = IndexReport(index=index_url)
        reports.append(report)
        try:
            shards = parse_index(fs.cat_file(index_url), index_url)
        except ValueError as err:
            report.errors.append(str(err))
            continue
        with tempfile.TemporaryDirectory(prefix="mds-verify-") as tmp:
            for info in shards:
                report.shards += 1
                report.samples += info.samples
                report.raw_bytes += info.raw_data.bytes
                report.stored_bytes += info.stored.bytes
                report.columns.update(info.columns)
                report.hashes.update(info.hashes)
                if info.compression:
                    report.compression.add(info.compression)
                stored_url = join_url(folder, info.stored.basename)
                try:
                    if local:
                        stored = Path(stored_url)
                    else:
                        stored = Path(tmp, info.stored.basename.replace("/", "_"))
                        fs.get_file(stored_url, str(stored))
                    raw_dest = Path(tmp, info.raw_basename.replace("/", "_"))
                    raw = unpack_shard(stored, info, raw_dest, source=stored_url)
                    _verify_shard(raw, info, vocab_size, report, allow_unsafe, stored_url)
                    for path in {stored, raw} - {Path(stored_url)}:
                        path.unlink()
                except (ShardCorruptError, FileNotFoundError, ValueError) as err:
                    report.errors.append(f"{stored_url}: {err}")
    return reports


def merge_indexes(url: str, subfolders: list[str] | None = None) -> list[ShardInfo]:
    """Write ``<url>/index.json`` listing the shards of each sub-folder's index.json.

    Sub-folders default to every direct sub-folder holding an index.json, in sorted order.
    """
    fs, root = storage.url_to_fs(url)
    if subfolders is None:
        if not fs.exists(root):
            raise MissingInput(f"{url} does not exist")
        subfolders = _subfolders_with_index(fs, root)
    if not subfolders:
        raise MissingInput(f"no sub-folder of {url} holds an {INDEX_NAME} to merge")
    merged: list[ShardInfo] = []
    for sub in subfolders:
        index_url = join_url(join_url(root, sub), INDEX_NAME)
        if not fs.exists(index_url):
            raise MissingInput(f"{index_url} does not exist")
        merged += [s.with_prefix(sub) for s in parse_index(fs.cat_file(index_url), index_url)]
    # mosaicml-streaming writes merged indexes with "version" first and without sort_keys.
    text = json.dumps({"version": 2, "shards": [s.to_json() for s in merged]})
    fs.pipe_file(join_url(root, INDEX_NAME), text.encode("utf-8"))
    return merged


def merge_folders(folders: list[str], out: str) -> tuple[list[ShardInfo], list[str]]:
    """Write ``<out>/index.json`` listing the shards of each of ``folders``, in the given order.

    A merged index names its shards relative to its own folder (that is how every reader
    resolves them, and no basename may climb out with ``..``), so a folder inside ``out`` is
    referenced where it is, and a folder elsewhere is first copied to ``out/<its name>``
    (shard by shard, streamed). Returns the merged shards and the folders that were copied.
    """
    out_fs, out_root = storage.url_to_fs(out)
    out_root = posixpath.normpath(out_root)
    subfolders: list[str] = []
    copied: list[str] = []
    for folder in folders:
        fs, root = storage.url_to_fs(folder)
        root = posixpath.normpath(root)
        index_url = join_url(root, INDEX_NAME)
        if not fs.exists(index_url):
            raise MissingInput(
                f"{folder} has no {INDEX_NAME}: give folders written by tokens_to_mds.py "
                "(or one DIR whose sub-folders hold one)"
            )
        same_fs = fs.protocol == out_fs.protocol
        if same_fs and root == out_root:
            raise UserError(f"{folder} is --out itself: give the folders to merge into it")
        if same_fs and root.startswith(out_root.rstrip("/") + "/"):
            sub = root[len(out_root.rstrip("/")) + 1 :]
        else:
            sub = posixpath.basename(root)
            _copy_dataset(fs, root, out_fs, join_url(out_root, sub), folder)
            copied.append(folder)
        if sub in subfolders:
            raise UserError(
                f"two folders to merge land in {join_url(out, sub)}: rename one of them"
            )
        subfolders.append(sub)
    return merge_indexes(out, subfolders), copied


def _copy_dataset(
    fs: fsspec.AbstractFileSystem,
    root: str,
    out_fs: fsspec.AbstractFileSystem,
    dest: str,
    folder: str,
) -> None:
    """Copy ``root``'s index.json and stored shards to ``dest``, refusing to overwrite."""
    dest_index = join_url(dest, INDEX_NAME)
    if out_fs.exists(dest_index):
        raise OutputExists(
            f"{dest} already holds a dataset, so {folder} cannot be copied there: "
            "remove it, or merge that folder instead"
        )
    index_url = join_url(root, INDEX_NAME)
    index_bytes = fs.cat_file(index_url)
    if isinstance(out_fs, LocalFileSystem):
        out_fs.makedirs(dest, exist_ok=True)
    for info in parse_index(index_bytes, index_url):
        name = info.stored.basename
        with (
            fs.open(join_url(root, name), "rb") as src,
            out_fs.open(join_url(dest, name), "wb") as dst,
        ):
            shutil.copyfileobj(src, dst, COPY_CHUNK)
    out_fs.pipe_file(dest_index, index_bytes)  # last: a dataset is complete once it has one

"""The local files of one stream's shards: read in place, or a cache of a remote copy.

A cache folder may be shared by every process of a machine (8 local ranks, their DataLoader
workers, a second run), with no shared memory and no coordinator:

    <local>/index.json                  copy of the remote index
    <local>/<raw basename>              decompressed shards, complete or absent, never partial
    <local>/<zip basename>              compressed shards, only with keep_zip
    <local>/<name>.tmp.<pid>.<random>   files being written (unique per writer)
    <local>/.locks/<raw basename>.lock  one flock per shard, taken to download or evict it
    <local>/.sources/<raw basename>.json  which remote object a cached shard came from
    <local>/.remote                     the remote this folder caches (refuses reuse for another)
    <local>/.node/<name>.<launch>       index, listing and meta.json as local rank 0 fetched
                                        them for this launch's other local ranks (node.py)

A shard file appears only by ``os.replace`` of a finished, size- and hash-checked temp file,
so readers need no lock: a file that exists is complete. Downloading or evicting a shard holds
its lock; a crashed holder's lock is released by the kernel and its temp files are deleted by
the next downloader of that shard (which holds the lock, so no live writer can own them).
Deleting a shard that another process has mapped is safe on POSIX: its mapping stays valid.
File modification times record use (:meth:`ShardCache.touch`), which makes least-recently-used
eviction work across processes.

A remote dataset may be rewritten in place while a cache still holds shards of the old one. So
every cached shard has a source record: its index entry (sizes and hashes) and the version the
store gave the object when the cache was opened (S3/GCS/Azure ETag or generation, a local
file's mtime), listed in one call per stream. On open, a cached shard whose record differs from
the current index entry and listing (or that has no record) is deleted and fetched again; an
index with hashes (data_prep records xxh64 by default) catches a rewrite even where the store
cannot be listed.

A cached file can also change after it was checked (a disk error, a stray write, a process that
could write in the folder: private.py refuses folders others can write). So when the index lists
hashes, each process hashes a shard's local file the first time it uses it, with the fastest
hash listed, never per sample and never again in that process (xxh64 reads ~2 GiB/s from the
page cache on one core: ~30 ms per 64 MiB shard, and the file is then in the page cache for the
reader). A mismatching cached shard is fetched again (with a warning); a mismatching in-place
shard, the only copy, is refused. DataLoader workers and local ranks each check the shards they
read, once; a shard this process downloaded was checked as it arrived.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import posixpath
import threading
from pathlib import Path
from typing import Any

from llmfoundry.data.mds import ShardCorruptError, ShardInfo, fastest, unpack_shard, verify_file
from llmfoundry.data.streaming.download import download
from llmfoundry.data.streaming.locking import file_lock
from llmfoundry.data.streaming.node import NodeShare
from llmfoundry.utils import storage
from llmfoundry.utils.errors import MissingInput, UserError
from llmfoundry.utils.files import atomic_write, fsync_path, join_url, temp_name

__all__ = ["ShardCache"]

_LOCKS = ".locks"
_SOURCES = ".sources"
_MARKER = ".remote"
# Keys of fsspec's file info that change when an object is rewritten, most specific first.
_VERSION_KEYS = ("ETag", "etag", "generation", "version_id", "mtime", "LastModified",
                 "last_modified", "updated")  # fmt: skip
_REFETCH = "fetching it again"
_ONLY_COPY = "it is read in place, the only copy: restore it from a backup or rewrite the dataset"

log = logging.getLogger(__name__)


class ShardCache:
    """Makes the shards of one stream available as local raw files.

    Args:
        shards: the stream's index entries.
        local: folder holding (or receiving) the raw shards.
        remote: folder URL of the stream's files; None when ``local`` is the only copy (read in
            place: never written, never evicted).
        validate_hash: the hash (one index.json lists) that downloads and, on their first use
            in a process, local shards are checked against; None: the fastest one the index
            lists (shards without hashes get only a size check).
        keep_zip: keep compressed shards next to the raw ones after decompressing them.
        storage_options: fsspec options for ``remote`` (credentials, endpoint_url, ...).
        retries: download attempts after the first.
        node: fetches the remote's listing once per machine (node.py); None lists here.
    """

    def __init__(
        self,
        shards: list[ShardInfo],
        local: str | os.PathLike,
        remote: str | None,
        *,
        validate_hash: str | None = None,
        keep_zip: bool = False,
        storage_options: dict[str, Any] | None = None,
        retries: int = 2,
        node: NodeShare | None = None,
    ) -> None:
        self.shards = shards
        self.local = Path(local)
        self.remote = remote
        self.validate_hash = validate_hash
        self.keep_zip = keep_zip
        self.storage_options = storage_options
        self.retries = retries
        self.node = node if remote is not None else None
        # (pid, shards hashed by that process, the lock its threads hash under); see _check.
        self._process: tuple[int, set[int], threading.Lock] | None = None
        if validate_hash is not None:
            lacking = [i for i, s in enumerate(shards) if validate_hash not in s.hashes]
            if lacking:
                raise UserError(
                    f"validate_hash={validate_hash!r} but shard(s) {lacking[:5]} of "
                    f"{remote or self.local} record only hashes "
                    f"{list(shards[lacking[0]].hashes)}; pick one of those or validate_hash=None"
                )
        self._versions: dict[str, str] = {}
        if remote is not None:
            self._claim()
            self._versions = self._list_versions()
            self._drop_stale()
        else:
            self._check_complete()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_process"] = None  # a copy in a DataLoader worker checks shards itself
        return state

    def _list_versions(self) -> dict[str, str]:
        """The remote's object versions, listed by the machine's leader when there is one."""
        remote = self.remote or ""
        if self.node is None:
            return _list_versions(remote, self.storage_options)
        listing = self.node.get(
            "listing.json",
            lambda: json.dumps(_list_versions(remote, self.storage_options)).encode(),
            f"the listing of {remote}",
        )
        return json.loads(listing)

    def _check_complete(self) -> None:
        """Fail now, not mid-epoch, when an in-place folder lacks a raw shard."""
        for j in range(len(self.shards)):
            if self.path(j).is_file():
                continue
            raise MissingInput(
                f"shard {self.path(j)} listed in {self.local / 'index.json'} is missing; the "
                "dataset folder is incomplete (rewrite it, or copy the missing shards)"
            )

    @property
    def evictable(self) -> bool:
        """Whether the shards have a remote copy, so deleting local files loses nothing."""
        return self.remote is not None

    def path(self, j: int) -> Path:
        """Local path of shard ``j``'s raw file."""
        return self.local / self.shards[j].raw_basename

    def _files(self, j: int) -> list[Path]:
        """Local files shard ``j`` may occupy (raw, and compressed with keep_zip)."""
        info = self.shards[j]
        files = [self.path(j)]
        if self.keep_zip and info.zip_basename is not None:
            files.append(self.local / info.zip_basename)
        return files

    def _source_file(self, j: int) -> Path:
        return self.local / _SOURCES / f"{self.shards[j].raw_basename}.json"

    def _source(self, j: int) -> str:
        """Shard ``j``'s current source record: its index entry and the remote's version."""
        info = self.shards[j]
        record = {
            "raw": info.raw_data.to_json(),
            "stored": info.stored.to_json(),
            "version": self._versions.get(info.stored.basename),
        }
        return json.dumps(record, sort_keys=True)

    def _is_current(self, j: int) -> bool:
        try:
            return self._source_file(j).read_text() == self._source(j)
        except FileNotFoundError:
            return False

    def _drop_stale(self) -> None:
        """Delete cached shards that came from another version of the remote (see above)."""
        stale = 0
        for j in range(len(self.shards)):
            if not any(f.exists() for f in self._files(j)) or self._is_current(j):
                continue
            with file_lock(self._lock(j)):
                if self._is_current(j):  # another process fetched the current one meanwhile
                    continue
                self._remove_leftovers(j)
                for f in self._files(j):
                    f.unlink(missing_ok=True)
                self._source_file(j).unlink(missing_ok=True)
                stale += 1
        if stale:
            log.info(
                "%s: %d cached shard(s) do not match %s as it is now (rewritten since, or "
                "cached without a source record); fetching them again",
                self.local,
                stale,
                self.remote,
            )

    def _lock(self, j: int) -> Path:
        return self.local / _LOCKS / f"{self.shards[j].raw_basename}.lock"

    def _claim(self) -> None:
        """Record which remote this folder caches; refuse a folder caching another one."""
        marker = self.local / _MARKER
        if not marker.exists():
            self.local.mkdir(parents=True, exist_ok=True)
            tmp = temp_name(marker)
            tmp.write_text(self.remote or "")
            try:
                os.link(tmp, marker)  # atomic create-if-absent, with the full content
            except FileExistsError:
                pass
            finally:
                tmp.unlink()
        owner = marker.read_text()
        if owner != self.remote:
            raise UserError(
                f"cache folder {self.local} already caches {owner!r}, not {self.remote!r}; "
                "give each dataset its own local folder (data.local in a training config, "
                "data.eval_datasets.<label>.local for an eval set), or delete the old cache"
            )

    def present(self, j: int) -> bool:
        """Whether shard ``j``'s raw file is local and complete (its size matches the index)."""
        try:
            return os.stat(self.path(j)).st_size == self.shards[j].raw_data.bytes
        except FileNotFoundError:
            return False

    def _hash(self, j: int) -> str | None:
        """The hash shard ``j`` is checked with (``validate_hash``, else the index's fastest)."""
        return self.validate_hash or fastest(self.shards[j].raw_data.hashes)

    def _checked(self) -> tuple[set[int], threading.Lock]:
        """The shards this process has hashed, and the lock its threads hash under."""
        if self._process is None or self._process[0] != os.getpid():
            self._process = (os.getpid(), set(), threading.Lock())
        return self._process[1], self._process[2]

    def _check(self, j: int) -> None:
        """Hash shard ``j``'s local file against index.json on its first use in this process
        (module docstring); raises ShardCorruptError naming it, or FileNotFoundError."""
        name = self._hash(j)
        checked, lock = self._checked()
        if name is None or j in checked:
            return
        with lock:  # the predownload thread and the reader: one hashes, the other waits
            if j not in checked:
                fix = _REFETCH if self.remote is not None else _ONLY_COPY
                verify_file(self.path(j), self.shards[j].raw_data, [name], fix=fix)
                checked.add(j)

    def _usable(self, j: int) -> bool:
        """Whether shard ``j``'s cached file is complete and matches index.json."""
        if not self.present(j):
            return False
        try:
            self._check(j)
        except (ShardCorruptError, FileNotFoundError):  # changed, or evicted meanwhile
            return False
        return True

    def ensure(self, j: int) -> tuple[Path, bool]:
        """Make shard ``j`` local; returns its raw path and whether this call downloaded it."""
        path = self.path(j)
        if self.remote is None:
            self._check(j)
            return path, False
        if self._usable(j):
            return path, False
        with file_lock(self._lock(j)):
            if self._usable(j):  # another process fetched it while we waited
                return path, False
            if self.present(j):
                log.warning(
                    "cached shard %s does not match its %s in index.json (changed since it was "
                    "fetched); fetching it again from %s",
                    path,
                    self._hash(j),
                    self.remote,
                )
            self._remove_leftovers(j)
            self._fetch(j)
        return path, True

    def _remove_leftovers(self, j: int) -> None:
        """Delete temp files of writers of shard ``j`` that died (we hold its lock)."""
        info = self.shards[j]
        for name in filter(None, (info.raw_basename, info.zip_basename)):
            target = self.local / name
            for leftover in target.parent.glob(f"{glob.escape(target.name)}.tmp.*"):
                leftover.unlink(missing_ok=True)

    def _fetch(self, j: int) -> None:
        info = self.shards[j]
        stored = info.zip_data or info.raw_data
        url = join_url(self.remote or "", stored.basename)
        raw_path = self.path(j)
        raw_path.parent.mkdir(parents=True, exist_ok=True)
        stored_tmp = temp_name(self.local / stored.basename)
        raw_tmp = temp_name(raw_path)
        name = self._hash(j)
        hashes = [name] if name else []
        try:
            download(url, stored_tmp, self.storage_options, self.retries)
            raw = unpack_shard(stored_tmp, info, raw_tmp, hashes, url)
            if raw == raw_tmp:  # decompressed here
                fsync_path(raw)
                if self.keep_zip:
                    os.replace(stored_tmp, self.local / stored.basename)
            self._checked()[0].add(j)  # checked above, before another thread can see the file
            os.replace(raw, raw_path)
        finally:
            stored_tmp.unlink(missing_ok=True)
            raw_tmp.unlink(missing_ok=True)
        atomic_write(self._source_file(j), self._source(j))  # after the shard: never ahead

    def touch(self, j: int) -> bool:
        """Mark shard ``j`` as just used (for LRU); False if it is gone (evicted)."""
        try:
            os.utime(self.path(j))
            return True
        except FileNotFoundError:
            return False

    def is_file(self, j: int, inode: int) -> bool:
        """Whether shard ``j``'s raw file is still the file with ``inode`` (not deleted/replaced)."""
        try:
            return os.stat(self.path(j)).st_ino == inode
        except FileNotFoundError:
            return False

    def usage(self) -> list[tuple[float, int, int]]:
        """(last use, bytes, shard) of every shard with local files."""
        out = []
        for j in range(len(self.shards)):
            stats = []
            for f in self._files(j):
                try:
                    stats.append(os.stat(f))
                except FileNotFoundError:
                    pass
            if stats:
                out.append((max(s.st_mtime for s in stats), sum(s.st_size for s in stats), j))
        return out

    def evict(self, j: int) -> int:
        """Delete shard ``j``'s local files unless someone is downloading it; returns bytes freed.

        Never touches a stream without a remote copy.
        """
        if not self.evictable:
            raise ValueError(f"refusing to evict {self.path(j)}: it is the only copy")
        freed = 0
        with file_lock(self._lock(j), blocking=False) as acquired:
            if not acquired:
                return 0
            for f in self._files(j):
                try:
                    size = f.stat().st_size
                    f.unlink()
                    freed += size
                except FileNotFoundError:
                    pass
            self._source_file(j).unlink(missing_ok=True)
        return freed

    def max_shard_bytes(self) -> int:
        """Bytes the largest shard occupies locally."""
        return max(
            (
                s.raw_data.bytes + (s.zip_data.bytes if self.keep_zip and s.zip_data else 0)
                for s in self.shards
            ),
            default=0,
        )


def _list_versions(remote: str, storage_options: dict[str, Any] | None) -> dict[str, str]:
    """Path (relative to ``remote``) -> the store's version of every object under ``remote``.

    One listing (paginated by the store), not a request per shard. A store that cannot be listed
    gives {} with a warning: the index's sizes and hashes are then the only check.
    """
    try:
        fs, root = storage.url_to_fs(remote, **(storage_options or {}))
        fs.invalidate_cache(root)  # a listing cached earlier in this process may be stale
        found = fs.find(root, detail=True)
    except Exception as err:  # permissions, network: staleness falls back to the index
        log.warning(
            "cannot list %s (%s); a cached shard is reused while it matches the index's size "
            "and hashes (write datasets with hashes, e.g. --hashes xxh64)",
            remote,
            err,
        )
        return {}
    versions = {}
    for path, info in found.items():
        version = next((info[k] for k in _VERSION_KEYS if info.get(k) is not None), None)
        if version is not None:
            versions[posixpath.relpath(path, root)] = f"{info.get('size')}:{version}"
    return versions

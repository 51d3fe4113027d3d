"""Write MDS shards and index.json as mosaicml-streaming's MDSWriter does.

index.json, raw and zstd shards are byte-identical to the reference writer's; gz shards differ
in the gzip header's mtime and OS byte (see FORMAT.md).

Samples are buffered until the next one would push the shard past ``size_limit`` (the exact
rule of FORMAT.md beside this file), then the shard is encoded, hashed, optionally compressed
and written.
``out`` may be a local folder or any fsspec URL (``s3://bucket/ds``): remote shards are staged
in a temporary folder, uploaded in background threads, and index.json is uploaded last, so a
reader never sees an index that lists a shard not yet there.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from fsspec.implementations.local import LocalFileSystem

from llmfoundry.data.mds import compression as compression_lib
from llmfoundry.data.mds.encodings import get_encoding
from llmfoundry.data.mds.hashing import digest, is_hash
from llmfoundry.data.mds.index import INDEX_NAME, FileInfo, ShardInfo, write_index
from llmfoundry.utils import storage
from llmfoundry.utils.errors import OutputExists, UserError
from llmfoundry.utils.files import atomic_write, join_url, parse_size

__all__ = ["MDSWriter"]

_MAX_SHARD = (1 << 32) - 1  # offsets are uint32


class MDSWriter:
    """Write samples (dicts of column -> value) as an MDS dataset.

    Args:
        out: local folder or fsspec URL of the dataset folder.
        columns: column name -> encoding (``{"tokens": "ndarray:uint16:2048"}``).
        compression: None, or ``"zstd"``, ``"zstd:7"``, ``"gz"``, ``"bz2"``, ``"br"``, ``"snappy"``.
        hashes: hash names to record per shard (``("sha1", "xxh64")``); stored sorted.
        size_limit: shard size limit in bytes (or text like ``"64mb"``), below 4 GiB (offsets
            are 32-bit); None for one shard.
        exist_ok: replace an existing dataset in ``out`` (only its index.json and shard files
            are removed). Otherwise an existing dataset is an error, never silently mixed.
        upload_workers: threads uploading shards when ``out`` is remote.
    """

    def __init__(
        self,
        out: str | os.PathLike,
        columns: dict[str, str],
        compression: str | None = None,
        hashes: tuple[str, ...] | list[str] = (),
        size_limit: int | str | None = 1 << 26,
        exist_ok: bool = False,
        upload_workers: int = 4,
    ) -> None:
        if not isinstance(columns, dict) or not columns:
            raise ValueError("columns must be a non-empty dict of column name -> encoding")
        self.column_names = sorted(columns)
        for name in self.column_names:
            if not isinstance(name, str) or not name:
                raise ValueError(f"column names must be non-empty strings, got {name!r}")
        try:
            self._coders = [get_encoding(columns[n]) for n in self.column_names]
        except ValueError as err:
            raise UserError(f"bad column encoding: {err}") from None
        self.column_encodings = [columns[n] for n in self.column_names]
        self.column_sizes = [c.size for c in self._coders]
        self.compression = compression or None
        if self.compression is not None:
            compression_lib.check_available(self.compression)
        unknown = [h for h in hashes if not is_hash(h)]
        if unknown:
            raise UserError(f"unknown hash(es) {unknown}; see llmfoundry.data.mds.HASH_NAMES")
        self.hashes = sorted(set(hashes))
        self.size_limit = parse_size(size_limit, "size_limit")
        if self.size_limit is not None and self.size_limit > _MAX_SHARD:
            raise UserError(
                f"size_limit={size_limit!r} is 4 GiB or more, but MDS shard offsets are 32-bit; "
                "use a size_limit below 4gb (the default is 64mb)"
            )

        self._config = {
            "column_encodings": self.column_encodings,
            "column_names": self.column_names,
            "column_sizes": self.column_sizes,
            "compression": self.compression,
            "format": "mds",
            "hashes": self.hashes,
            "size_limit": self.size_limit,
            "version": 2,
        }
        self._config_bytes = json.dumps(self._config, sort_keys=True).encode("utf-8")
        self._shard_overhead = 4 + 4 + len(self._config_bytes)  # N, offsets[N], config

        self.out = str(out)
        self._fs, self._root = storage.url_to_fs(self.out)
        self._remote = not isinstance(self._fs, LocalFileSystem)
        self._prepare_out(exist_ok)
        if self._remote:
            self._local = Path(tempfile.mkdtemp(prefix="mds-writer-"))
            self._pool: ThreadPoolExecutor | None = ThreadPoolExecutor(upload_workers)
        else:
            self._local = Path(self._root)
            self._local.mkdir(parents=True, exist_ok=True)
            self._pool = None
        self._uploads: list[Future] = []
        self.shards: list[ShardInfo] = []
        self._samples: list[bytes] = []
        self._shard_size = self._shard_overhead
        self._finished = False

    # -- output folder -------------------------------------------------------------------

    def _existing(self) -> list[str]:
        """Paths (in ``self._fs``) of an existing dataset's index.json and shard files."""
        if not self._fs.exists(self._root):
            return []
        found = self._fs.glob(join_url(self._root, "shard.*.mds*"))
        index = join_url(self._root, INDEX_NAME)
        if self._fs.exists(index):
            found.insert(0, index)  # removed first: no index may point at half-removed shards
        return found

    def _prepare_out(self, exist_ok: bool) -> None:
        existing = self._existing()
        if existing and not exist_ok:
            raise OutputExists(
                f"{self.out} already holds an MDS dataset ({len(existing)} files); pass "
                "exist_ok=True (CLI: --overwrite) to replace it, or choose another folder"
            )
        for path in existing:
            self._fs.rm(path)

    # -- writing -------------------------------------------------------------------------

    def encode_sample(self, sample: dict[str, Any]) -> bytes:
        """One sample's bytes: uint32 sizes of variable columns, then each column's bytes."""
        if not isinstance(sample, dict):
            raise TypeError(f"a sample must be a dict of column -> value, got {type(sample)}")
        if sample.keys() != set(self.column_names):
            missing = sorted(set(self.column_names) - sample.keys())
            extra = sorted(sample.keys() - set(self.column_names))
            raise KeyError(
                f"sample columns do not match the writer's: missing {missing}, unexpected {extra}"
            )
        sizes, parts = [], []
        for name, coder in zip(self.column_names, self._coders, strict=True):
            try:
                data = coder.encode(sample[name])
            except (TypeError, ValueError) as err:
                raise type(err)(f"column {name!r}: {err}") from None
            if coder.size is None:
                sizes.append(len(data))
            parts.append(data)
        return np.asarray(sizes, np.uint32).tobytes() + b"".join(parts)

    def write(self, sample: dict[str, Any]) -> None:
        """Add one sample, first closing the current shard if the sample would overflow it."""
        if self._finished:
            raise RuntimeError(f"MDSWriter for {self.out} is already finished")
        self._raise_upload_errors()
        data = self.encode_sample(sample)
        cost = len(data) + 4  # the sample plus its offset
        if self.size_limit and self._samples and self.size_limit < self._shard_size + cost:
            self._flush()
        self._samples.append(data)
        self._shard_size += cost

    def _flush(self) -> None:
        n = len(self._samples)
        header_size = 4 + 4 * (n + 1) + len(self._config_bytes)
        lengths = np.fromiter((len(s) for s in self._samples), np.int64, count=n)
        offsets = header_size + np.concatenate([[0], np.cumsum(lengths)])
        if offsets[-1] > _MAX_SHARD:
            raise UserError(
                f"shard of {int(offsets[-1])} bytes exceeds the format's 4 GiB limit; "
                "set a smaller size_limit"
            )
        raw = b"".join(
            [
                np.uint32(n).tobytes(),
                offsets.astype(np.uint32).tobytes(),
                self._config_bytes,
                *self._samples,
            ]
        )
        raw_name = f"shard.{len(self.shards):05d}.mds"
        raw_info = FileInfo(raw_name, len(raw), {h: digest(h, raw) for h in self.hashes})
        zip_info = None
        data, name = raw, raw_name
        if self.compression:
            data = compression_lib.compress(raw, self.compression)
            name = f"{raw_name}.{compression_lib.extension(self.compression)}"
            zip_info = FileInfo(name, len(data), {h: digest(h, data) for h in self.hashes})
        self._write_file(name, data)
        self.shards.append(
            ShardInfo(
                column_encodings=tuple(self.column_encodings),
                column_names=tuple(self.column_names),
                column_sizes=tuple(self.column_sizes),
                compression=self.compression,
                hashes=tuple(self.hashes),
                raw_data=raw_info,
                samples=n,
                size_limit=self.size_limit,
                zip_data=zip_info,
            )
        )
        self._samples = []
        self._shard_size = self._shard_overhead

    def _write_file(self, name: str, data: bytes) -> None:
        path = self._local / name
        atomic_write(path, data)
        if self._remote:
            self._uploads.append(self._pool.submit(self._upload, path, name))  # type: ignore[union-attr]

    def _upload(self, path: Path, name: str) -> None:
        self._fs.put_file(str(path), join_url(self._root, name))
        path.unlink()

    def _raise_upload_errors(self) -> None:
        done = [f for f in self._uploads if f.done()]
        self._uploads = [f for f in self._uploads if not f.done()]
        for future in done:
            future.result()

    def finish(self) -> list[ShardInfo]:
        """Flush the last shard, wait for uploads, then write index.json (last)."""
        if self._finished:
            return self.shards
        if self._samples:
            self._flush()
        for future in self._uploads:
            future.result()
        self._uploads = []
        write_index(self._local, self.shards)
        if self._remote:
            self._upload(self._local / INDEX_NAME, INDEX_NAME)
            self._cleanup()
        self._finished = True
        return self.shards

    def abort(self) -> None:
        """Stop without an index.json, removing the shards written so far."""
        if self._finished:
            return
        self._finished = True
        for future in self._uploads:
            future.cancel()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        names = [s.stored.basename for s in self.shards]
        for name in names:
            if self._remote:
                target = join_url(self._root, name)
                if self._fs.exists(target):
                    self._fs.rm(target)
            else:
                (self._local / name).unlink(missing_ok=True)
        if self._remote:
            shutil.rmtree(self._local, ignore_errors=True)

    def _cleanup(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        shutil.rmtree(self._local, ignore_errors=True)

    def __enter__(self) -> MDSWriter:
        return self

    def __exit__(self, exc_type: type | None, *exc: object) -> None:
        if exc_type is None:
            self.finish()
        else:
            self.abort()

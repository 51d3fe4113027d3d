"""Read samples from one local, uncompressed MDS shard through mmap.

The shard is mapped once; a sample costs two offset lookups and a slice, so random access is as
cheap as sequential access and the OS page cache is shared by every process reading the same
file. The header is checked against the index entry when the reader opens, so a truncated or
wrong file fails loudly (naming the file) instead of returning wrong samples.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from llmfoundry.data.mds.compression import decompress_to
from llmfoundry.data.mds.encodings import NDArray, UnsafeEncodingError, get_encoding
from llmfoundry.data.mds.hashing import file_digest
from llmfoundry.data.mds.index import FileInfo, ShardInfo
from llmfoundry.utils.errors import MissingInput, UserError

__all__ = ["ShardCorruptError", "ShardReader", "unpack_shard", "verify_file", "verify_shard"]


class ShardCorruptError(UserError):
    """A shard file does not match its index entry (truncated, wrong, or bit-flipped).

    A UserError: the message names the file and the fix (delete it, fetch or rewrite it), so
    the scripts report it as one line rather than a traceback through the data loader.
    """


class ShardReader:
    """Random access to the samples of one raw (decompressed) shard file.

    ``get(i)`` returns a dict of decoded column values that owns its memory; ``get_array``
    and ``array`` return numpy views into the mapped file (no copy), valid while the reader is
    open, for the hot path of fixed-size token rows.
    """

    def __init__(self, path: str | os.PathLike, info: ShardInfo, allow_unsafe: bool = False):
        self.path = Path(path)
        self.info = info
        self._coders = [get_encoding(e, allow_unsafe) for e in info.column_encodings]
        self._var_cols = [i for i, c in enumerate(self._coders) if c.size is None]
        self._col_index = {name: i for i, name in enumerate(info.column_names)}
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            raise MissingInput(f"shard file {self.path} does not exist") from None
        try:
            stat = os.fstat(fd)
            size = stat.st_size
            self.inode = stat.st_ino  # lets a cache tell the mapped file from a newer copy
            self._check(size >= 4, f"file is {size} bytes, too short for an MDS header")
            self._mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)
        n = int(np.frombuffer(self._mm, np.uint32, count=1)[0])
        self._check(
            n == info.samples, f"header says {n} samples but index.json says {info.samples}"
        )
        self._check(size >= 4 * (n + 2), f"file is {size} bytes, too short for {n} offsets")
        self._offsets = np.frombuffer(self._mm, np.uint32, count=n + 1, offset=4).astype(np.int64)
        self._check(
            int(self._offsets[-1]) == size,
            f"last offset {int(self._offsets[-1])} != file size {size} (truncated or corrupt)",
        )
        self._check(
            size == info.raw_data.bytes,
            f"file is {size} bytes but index.json says {info.raw_data.bytes}",
        )
        self._check(
            n == 0
            or (self._offsets[0] >= 4 * (n + 2) and bool(np.all(np.diff(self._offsets) >= 0))),
            "sample offsets are out of order (corrupt header)",
        )
        self._n = n

    def _check(self, cond: bool, msg: str) -> None:
        if not cond:
            raise ShardCorruptError(
                f"corrupt MDS shard {self.path}: {msg}; delete it (and re-download or rewrite it)"
            )

    def __len__(self) -> int:
        return self._n

    def __enter__(self) -> ShardReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Unmap the file. Arrays still viewing it keep the mapping alive until they go."""
        mm, self._mm = self._mm, None
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                pass  # views from get_array()/array() are alive; the GC unmaps later

    def _span(self, i: int) -> tuple[int, int]:
        if not -self._n <= i < self._n:
            raise IndexError(f"sample {i} out of range for shard {self.path} of {self._n}")
        if self._mm is None:
            raise ValueError(f"shard reader for {self.path} is closed")
        i %= self._n
        return int(self._offsets[i]), int(self._offsets[i + 1])

    def get_bytes(self, i: int) -> bytes:
        """The encoded bytes of sample ``i``."""
        start, end = self._span(i)
        return self._mm[start:end]

    def _columns(self, buf: memoryview) -> list[memoryview]:
        """Split one sample's bytes into per-column slices."""
        nvar = len(self._var_cols)
        if 4 * nvar > len(buf):
            raise ShardCorruptError(f"corrupt sample in {self.path}: header exceeds sample")
        var_sizes = iter(np.frombuffer(buf, np.uint32, count=nvar).tolist())
        pos, parts = 4 * nvar, []
        for coder in self._coders:
            size = coder.size if coder.size is not None else next(var_sizes)
            parts.append(buf[pos : pos + size])
            pos += size
        if pos != len(buf):
            raise ShardCorruptError(
                f"corrupt sample in {self.path}: columns take {pos} bytes, sample has {len(buf)}"
            )
        return parts

    def get(self, i: int) -> dict[str, Any]:
        """Sample ``i`` decoded into ``{column: value}`` (values own their memory)."""
        # A bytearray, so decoded arrays are writable: torch.as_tensor (default collate) and
        # algorithms that change a batch in place must not write into immutable memory.
        parts = self._columns(memoryview(bytearray(self.get_bytes(i))))
        out = {}
        for name, coder, part in zip(self.info.column_names, self._coders, parts, strict=True):
            try:
                out[name] = coder.decode(part)
            except UnsafeEncodingError:
                raise
            except (ValueError, UnicodeDecodeError) as err:
                raise ShardCorruptError(
                    f"corrupt sample {i} column {name!r} in {self.path}: {err}"
                ) from err
        return out

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.get(i)

    def _ndarray_coder(self, column: str) -> tuple[int, NDArray]:
        if column not in self._col_index:
            raise KeyError(
                f"no column {column!r} in {self.path}; columns: {self.info.column_names}"
            )
        j = self._col_index[column]
        coder = self._coders[j]
        if not isinstance(coder, NDArray):
            raise TypeError(f"column {column!r} is {coder.name}, not an ndarray encoding")
        return j, coder

    def get_array(self, i: int, column: str) -> np.ndarray:
        """Column ``column`` (an ndarray encoding) of sample ``i`` as a read-only view."""
        j, coder = self._ndarray_coder(column)
        start, end = self._span(i)
        return coder.decode(self._columns(memoryview(self._mm)[start:end])[j])

    def array(self, column: str) -> np.ndarray:
        """The whole shard's ``column`` as one ``[samples, *shape]`` read-only view.

        Needs every column to have a fixed size (``ndarray:uint16:L`` token rows), so that
        samples sit at a constant stride with no per-sample header.
        """
        j, coder = self._ndarray_coder(column)
        if self._var_cols or coder.size is None:
            raise ValueError(
                f"array() needs fixed-size columns (e.g. ndarray:uint16:2048); {self.path} has "
                f"{dict(zip(self.info.column_names, self.info.column_encodings, strict=True))}"
            )
        if self._mm is None:
            raise ValueError(f"shard reader for {self.path} is closed")
        stride = sum(c.size for c in self._coders)  # type: ignore[misc]
        start = int(self._offsets[0]) if self._n else 0
        self._check(
            int(self._offsets[-1]) - start == stride * self._n,
            f"samples are not all {stride} bytes",
        )
        col_start = sum(c.size for c in self._coders[:j])  # type: ignore[misc]
        rows = np.frombuffer(self._mm, np.uint8, count=stride * self._n, offset=start)
        rows = rows.reshape(self._n, stride)[:, col_start : col_start + coder.size]
        return rows.view(np.dtype(coder.dtype)).reshape(self._n, *coder.shape)


_FIX = "delete it (and re-download or rewrite it), or rewrite the remote copy if it is damaged"


def _hash_names(expected: FileInfo, hashes: Iterable[str] | None) -> list[str]:
    """The hashes to check: those asked for (all when None) that the index lists."""
    return sorted(expected.hashes if hashes is None else set(hashes) & set(expected.hashes))


def _check_digests(
    actual: dict[str, str], expected: FileInfo, source: object, fix: str = _FIX
) -> None:
    for algo, got in sorted(actual.items()):
        if got != expected.hashes[algo]:
            raise ShardCorruptError(
                f"corrupt MDS shard {source}: {algo} is {got}, index.json says "
                f"{expected.hashes[algo]}; {fix}"
            )


def verify_file(
    path: str | os.PathLike,
    expected: FileInfo,
    hashes: Iterable[str] | None = None,
    source: str | None = None,
    fix: str = _FIX,
) -> None:
    """Check a file's size and hashes against its index entry; raise ShardCorruptError.

    ``hashes`` limits the check to those names (None: every hash the index lists); ``source``
    is how the message names the file (its URL when ``path`` is a download's temp file);
    ``fix`` ends the message (what to do about it).
    """
    path = Path(path)
    source = source or str(path)
    if not path.is_file():
        raise MissingInput(f"shard file {source} does not exist")
    size = path.stat().st_size
    if size != expected.bytes:
        raise ShardCorruptError(
            f"corrupt MDS shard {source}: {size} bytes, index.json says {expected.bytes}; {fix}"
        )
    _check_digests(file_digest(_hash_names(expected, hashes), path), expected, source, fix)


def unpack_shard(
    stored: str | os.PathLike,
    info: ShardInfo,
    raw_dest: str | os.PathLike,
    hashes: Iterable[str] | None = None,
    source: str | None = None,
) -> Path:
    """Verify a shard file as stored (compressed or not) and decompress it; returns the raw file.

    The one check of a fetched shard, shared by the streaming cache and ``verify_mds``: stored
    size and hashes, then (for compressed shards) decompression into ``raw_dest`` (overwritten;
    not atomic: pass a temp name), capped at the index's raw size, then raw hashes. Returns
    ``stored`` itself when it is the raw shard (nothing is written), else ``raw_dest``.
    """
    source = source or str(stored)
    if info.zip_data is None:
        verify_file(stored, info.raw_data, hashes, source)
        return Path(stored)
    verify_file(stored, info.zip_data, hashes, source)
    expected = info.raw_data.bytes
    try:
        with open(stored, "rb") as src, open(raw_dest, "wb") as dst:
            size = decompress_to(src, dst, info.compression or "", expected)
    except ValueError as err:
        raise ShardCorruptError(f"corrupt MDS shard {source}: {err}; {_FIX}") from err
    if size != expected:
        raise ShardCorruptError(
            f"corrupt MDS shard {source}: decompresses to {size} bytes, index.json says "
            f"{expected}; {_FIX}"
        )
    names = _hash_names(info.raw_data, hashes)
    _check_digests(file_digest(names, raw_dest), info.raw_data, source)
    return Path(raw_dest)


def verify_shard(path: str | os.PathLike, info: ShardInfo) -> None:
    """Verify a shard file against its index entry.

    ``path`` may be the raw shard or the compressed one (told apart by the basename's file
    name); hashes are those index.json lists for that file.
    """
    name = Path(path).name
    if info.zip_data is not None and name == Path(info.zip_data.basename).name:
        verify_file(path, info.zip_data)
    else:
        verify_file(path, info.raw_data)

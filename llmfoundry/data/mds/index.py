"""index.json: the list of shards of an MDS dataset, parsed strictly.

Every shard entry has exactly the keys listed in FORMAT.md beside this file (the reference reader
rejects unknown keys, so accepting them here would let us write indexes it cannot read). Basenames may carry a
sub-folder (merged indexes: ``"train/shard.00000.mds"``) but never escape the dataset folder.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from llmfoundry.data.mds.compression import extension, is_compression
from llmfoundry.data.mds.encodings import get_encoding
from llmfoundry.data.mds.hashing import is_hash
from llmfoundry.utils.errors import MissingInput, UserError
from llmfoundry.utils.files import atomic_write

__all__ = [
    "INDEX_NAME",
    "FileInfo",
    "ShardInfo",
    "check_basename",
    "dump_index",
    "load_index",
    "parse_index",
    "write_index",
]

INDEX_NAME = "index.json"

SHARD_KEYS = frozenset(
    {
        "column_encodings", "column_names", "column_sizes", "compression", "format", "hashes",
        "raw_data", "samples", "size_limit", "version", "zip_data",
    }
)  # fmt: skip
_FILE_KEYS = frozenset({"basename", "bytes", "hashes"})


def check_basename(basename: str) -> str:
    """Return ``basename`` if it is a safe relative POSIX path inside the dataset folder.

    A crafted index must not make us read or write outside the folder (``../../etc/passwd``).
    """
    if not isinstance(basename, str) or not basename:
        raise UserError(f"shard basename must be a non-empty string, got {basename!r}")
    path = PurePosixPath(basename)
    if (
        path.is_absolute()
        or "\\" in basename
        or ":" in path.parts[0]
        or any(part in ("..", ".", "") for part in path.parts)
        or str(path) != basename
    ):
        raise UserError(
            f"unsafe shard basename {basename!r}: it must be a relative path inside the dataset "
            "folder (like 'shard.00000.mds' or 'train/shard.00000.mds'), without '..'"
        )
    return basename


def _require(cond: bool, where: str, msg: str) -> None:
    if not cond:
        raise UserError(f"{where}: {msg}")


@dataclass(frozen=True)
class FileInfo:
    """One file of a shard: its basename (relative to the index's folder), size and hashes."""

    basename: str
    bytes: int
    hashes: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def from_json(cls, obj: Any, where: str = "file") -> FileInfo:
        _require(isinstance(obj, dict), where, f"expected an object, got {obj!r:.80}")
        keys = set(obj)
        _require(
            keys == _FILE_KEYS,
            where,
            f"keys must be exactly {sorted(_FILE_KEYS)}; "
            f"unknown {sorted(keys - _FILE_KEYS)}, missing {sorted(_FILE_KEYS - keys)}",
        )
        size, hashes = obj["bytes"], obj["hashes"]
        _require(_is_count(size), where, f"'bytes' must be a non-negative integer, got {size!r}")
        _require(
            isinstance(hashes, dict)
            and all(is_hash(k) and isinstance(v, str) for k, v in hashes.items()),
            where,
            f"'hashes' must map known hash names to hex digests, got {hashes!r:.120}",
        )
        try:
            basename = check_basename(obj["basename"])
        except ValueError as err:
            raise UserError(f"{where}: {err}") from None
        return cls(basename, size, dict(hashes))

    def to_json(self) -> dict[str, Any]:
        return {"basename": self.basename, "bytes": self.bytes, "hashes": dict(self.hashes)}


@dataclass(frozen=True)
class ShardInfo:
    """One shard entry of index.json (field names are the JSON keys)."""

    column_encodings: tuple[str, ...]
    column_names: tuple[str, ...]
    column_sizes: tuple[int | None, ...]
    compression: str | None
    hashes: tuple[str, ...]
    raw_data: FileInfo
    samples: int
    size_limit: int | None
    zip_data: FileInfo | None
    format: str = "mds"
    version: int = 2

    # Convenience views used by readers and the streaming cache.
    @property
    def raw_basename(self) -> str:
        """Path of the uncompressed shard relative to the index's folder."""
        return self.raw_data.basename

    @property
    def zip_basename(self) -> str | None:
        """Path of the compressed shard, or None when the shard is stored uncompressed."""
        return self.zip_data.basename if self.zip_data else None

    @property
    def stored(self) -> FileInfo:
        """The file actually stored remotely: the compressed one when there is one."""
        return self.zip_data or self.raw_data

    @property
    def columns(self) -> dict[str, str]:
        """Column name -> encoding."""
        return dict(zip(self.column_names, self.column_encodings, strict=True))

    @classmethod
    def from_json(cls, obj: Any, where: str = "shard") -> ShardInfo:
        """Validate and convert one index.json shard entry; errors name ``where``."""
        _check_shard_keys(obj, where)
        names, encs, sizes = _check_columns(obj, where)
        compression, raw, zipped = _check_files(obj, where)
        hashes = obj["hashes"]
        _require(
            isinstance(hashes, list) and all(isinstance(h, str) and is_hash(h) for h in hashes),
            where,
            f"hashes must be a list of known hash names, got {hashes!r}",
        )
        samples, size_limit = obj["samples"], obj["size_limit"]
        _require(
            _is_count(samples), where, f"samples must be a non-negative integer, got {samples!r}"
        )
        _require(
            size_limit is None or (isinstance(size_limit, int) and size_limit > 0),
            where,
            f"size_limit must be a positive integer or null, got {size_limit!r}",
        )
        return cls(
            column_encodings=tuple(encs),
            column_names=tuple(names),
            column_sizes=tuple(sizes),
            compression=compression,
            hashes=tuple(hashes),
            raw_data=raw,
            samples=samples,
            size_limit=size_limit,
            zip_data=zipped,
            format="mds",
            version=2,
        )

    def to_json(self) -> dict[str, Any]:
        """The index.json entry (keys in sorted order, as the reference writes them)."""
        return {
            "column_encodings": list(self.column_encodings),
            "column_names": list(self.column_names),
            "column_sizes": list(self.column_sizes),
            "compression": self.compression,
            "format": self.format,
            "hashes": list(self.hashes),
            "raw_data": self.raw_data.to_json(),
            "samples": self.samples,
            "size_limit": self.size_limit,
            "version": self.version,
            "zip_data": self.zip_data.to_json() if self.zip_data else None,
        }

    def config_json(self) -> dict[str, Any]:
        """The shard's header config: the entry without samples/raw_data/zip_data."""
        obj = self.to_json()
        for key in ("samples", "raw_data", "zip_data"):
            del obj[key]
        return obj

    def with_prefix(self, prefix: str) -> ShardInfo:
        """This entry with basenames under sub-folder ``prefix`` (for merged indexes)."""
        prefix = check_basename(prefix.strip("/"))

        def moved(info: FileInfo) -> FileInfo:
            return FileInfo(f"{prefix}/{info.basename}", info.bytes, dict(info.hashes))

        return ShardInfo(
            column_encodings=self.column_encodings,
            column_names=self.column_names,
            column_sizes=self.column_sizes,
            compression=self.compression,
            hashes=self.hashes,
            raw_data=moved(self.raw_data),
            samples=self.samples,
            size_limit=self.size_limit,
            zip_data=moved(self.zip_data) if self.zip_data else None,
        )


def _is_count(value: Any) -> bool:
    """A non-negative JSON integer (``true`` is not one)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_shard_keys(obj: Any, where: str) -> None:
    """An object with exactly the MDS shard keys, of format 'mds' version 2."""
    _require(isinstance(obj, dict), where, f"expected an object, got {obj!r:.80}")
    keys = set(obj)
    unknown, missing = sorted(keys - SHARD_KEYS), sorted(SHARD_KEYS - keys)
    _require(
        not unknown and not missing,
        where,
        (f"unknown key(s) {unknown}" if unknown else "")
        + ("; " if unknown and missing else "")
        + (f"missing key(s) {missing}" if missing else "")
        + f" (an MDS shard entry has exactly {sorted(SHARD_KEYS)})",
    )
    _require(
        obj["format"] == "mds",
        where,
        f"format {obj['format']!r} is not supported; only 'mds' shards can be read",
    )
    _require(obj["version"] == 2, where, f"version must be 2, got {obj['version']!r}")


def _check_columns(obj: dict[str, Any], where: str) -> tuple[list, list, list]:
    """The entry's column names, encodings and sizes: aligned, distinct, sizes as encoded."""
    names, encs, sizes = obj["column_names"], obj["column_encodings"], obj["column_sizes"]
    _require(
        all(isinstance(x, list) for x in (names, encs, sizes))
        and len(names) == len(encs) == len(sizes)
        and len(names) > 0,
        where,
        "column_names, column_encodings and column_sizes must be non-empty lists of equal length",
    )
    _require(
        all(isinstance(n, str) and n for n in names) and len(set(names)) == len(names),
        where,
        f"column_names must be distinct non-empty strings, got {names}",
    )
    for name, enc, size in zip(names, encs, sizes, strict=True):
        try:
            coder = get_encoding(enc)
        except (ValueError, TypeError) as err:
            raise UserError(f"{where}: column {name!r}: {err}") from None
        _require(
            coder.size == size,
            where,
            f"column {name!r} ({enc}) has size {size!r} but its encoding gives {coder.size}",
        )
    return names, encs, sizes


def _check_files(obj: dict[str, Any], where: str) -> tuple[str | None, FileInfo, FileInfo | None]:
    """The entry's compression and its raw and compressed files, consistent with each other."""
    compression = obj["compression"]
    _require(
        compression is None or (isinstance(compression, str) and is_compression(compression)),
        where,
        f"unknown compression {compression!r}",
    )
    raw = FileInfo.from_json(obj["raw_data"], f"{where} raw_data")
    zipped = None
    if obj["zip_data"] is not None:
        zipped = FileInfo.from_json(obj["zip_data"], f"{where} zip_data")
    _require(
        (compression is None) == (zipped is None),
        where,
        "zip_data must be given exactly when compression is set",
    )
    if zipped is not None:
        _require(
            zipped.basename.endswith("." + extension(compression)),
            where,
            f"zip_data basename {zipped.basename!r} does not end in '.{extension(compression)}'",
        )
    return compression, raw, zipped


def parse_index(text: str | bytes, source: str = INDEX_NAME) -> list[ShardInfo]:
    """Parse index.json text; errors name ``source`` and the shard entry."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as err:
        raise UserError(
            f"{source}: not valid JSON ({err}); the index is damaged: rewrite the dataset "
            "(data_prep/tokens_to_mds.py --overwrite) or restore the file"
        ) from None
    _require(
        isinstance(obj, dict) and set(obj) == {"shards", "version"},
        source,
        "an MDS index is an object with exactly the keys 'shards' and 'version'",
    )
    _require(obj["version"] == 2, source, f"index version must be 2, got {obj['version']!r}")
    _require(isinstance(obj["shards"], list), source, "'shards' must be a list")
    shards = [
        ShardInfo.from_json(entry, f"{source}: shard {i}") for i, entry in enumerate(obj["shards"])
    ]
    seen: set[str] = set()
    for i, shard in enumerate(shards):
        for name in filter(None, (shard.raw_basename, shard.zip_basename)):
            _require(name not in seen, source, f"shard {i}: basename {name!r} listed twice")
            seen.add(name)
    return shards


def load_index(path: str | os.PathLike) -> list[ShardInfo]:
    """Read ``<folder>/index.json`` (or the index file itself) from local disk."""
    path = Path(path)
    if path.is_dir():
        path = path / INDEX_NAME
    if not path.is_file():
        raise MissingInput(
            f"no MDS index at {path}; expected a folder containing {INDEX_NAME} "
            "(written by MDSWriter or data_prep/tokens_to_mds.py)"
        )
    return parse_index(path.read_bytes(), str(path))


def dump_index(shards: Iterable[ShardInfo]) -> bytes:
    """index.json bytes exactly as the reference writer produces them."""
    obj = {"shards": [s.to_json() for s in shards], "version": 2}
    return json.dumps(obj, sort_keys=True).encode("utf-8")


def write_index(folder: str | os.PathLike, shards: Sequence[ShardInfo]) -> Path:
    """Write ``<folder>/index.json`` atomically (temp file then rename) and return its path."""
    path = Path(folder) / INDEX_NAME
    atomic_write(path, dump_index(shards))
    return path

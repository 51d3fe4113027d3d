"""Shard compression: ``zstd``, ``gz``, ``bz2``, ``br``, ``snappy``, optionally ``:LEVEL``.

Names, levels and defaults are those of mosaicml-streaming, so index.json files agree. Only
zstd, gz and bz2 are required; brotli and snappy are imported on first use and name the package
to install when missing. gzip output uses mtime 0 so our compressed shards are reproducible.
"""

from __future__ import annotations

import bz2
import gzip
import importlib
from dataclasses import dataclass
from types import ModuleType

from llmfoundry.utils.errors import MissingPackage, UserError

__all__ = ["compress", "decompress", "extension", "is_compression", "parse_compression"]


@dataclass(frozen=True)
class _Family:
    levels: range | None  # None: no levels
    default: int | None
    module: str  # import name
    package: str  # pip name


_FAMILIES = {
    "zstd": _Family(range(1, 23), 3, "zstandard", "zstandard"),
    "gz": _Family(range(0, 10), 9, "gzip", ""),
    "bz2": _Family(range(1, 10), 9, "bz2", ""),
    "br": _Family(range(0, 12), 11, "brotli", "brotli"),
    "snappy": _Family(None, None, "snappy", "python-snappy"),
}


def parse_compression(algo: str) -> tuple[str, int | None]:
    """Split ``"zstd:7"`` into ``("zstd", 7)``; the level defaults per family."""
    family, sep, level_text = algo.partition(":") if isinstance(algo, str) else ("", "", "")
    spec = _FAMILIES.get(family)
    if spec is None:
        raise UserError(
            f"unknown compression {algo!r}; use one of {sorted(_FAMILIES)}, optionally "
            "with :LEVEL (e.g. zstd:7)"
        )
    if not sep:
        return family, spec.default
    if spec.levels is None:
        raise UserError(f"compression {family!r} takes no level, got {algo!r}")
    try:
        level = int(level_text)
    except ValueError:
        level = -1
    if level not in spec.levels or str(level) != level_text:
        raise UserError(
            f"bad level in {algo!r}; {family} levels are "
            f"{spec.levels.start}..{spec.levels.stop - 1}"
        )
    return family, level


def is_compression(algo: str | None) -> bool:
    """Whether ``algo`` names a supported compression (None means none, and is valid)."""
    if algo is None:
        return True
    try:
        parse_compression(algo)
    except ValueError:
        return False
    return True


def extension(algo: str) -> str:
    """File extension of compressed shards: the family name (``"zstd:7"`` -> ``"zstd"``)."""
    return parse_compression(algo)[0]


def _module(family: str) -> ModuleType:
    spec = _FAMILIES[family]
    try:
        return importlib.import_module(spec.module)
    except ImportError:
        raise MissingPackage(
            f"compression {family!r} needs the {spec.package!r} package: pip install {spec.package}"
        ) from None


def check_available(algo: str) -> None:
    """Raise ImportError now (naming the package) if ``algo``'s library is missing."""
    _module(parse_compression(algo)[0])


def compress(data: bytes, algo: str) -> bytes:
    """Compress ``data`` with ``algo`` (``"zstd"``, ``"gz:6"``, ...)."""
    family, level = parse_compression(algo)
    mod = _module(family)
    if family == "zstd":
        return mod.ZstdCompressor(level=level).compress(data)
    if family == "gz":
        return gzip.compress(data, compresslevel=level, mtime=0)
    if family == "bz2":
        return bz2.compress(data, level)
    if family == "br":
        return mod.compress(data, quality=level)
    return mod.compress(data)


def decompress(data: bytes, algo: str) -> bytes:
    """Decompress ``data``; corrupt input raises ValueError naming the algorithm."""
    family, _ = parse_compression(algo)
    mod = _module(family)
    try:
        if family == "zstd":
            # decompressobj copes with frames that do not record their content size.
            reader = mod.ZstdDecompressor().decompressobj(read_across_frames=True)
            return reader.decompress(data) + reader.flush()
        if family == "gz":
            return gzip.decompress(data)
        if family == "bz2":
            return bz2.decompress(data)
        return mod.decompress(data)
    except MemoryError:
        raise
    except Exception as err:  # each library has its own error type (zstandard.ZstdError, ...)
        raise ValueError(f"corrupt {family} data: {err}") from err

"""Shard compression: ``zstd``, ``gz``, ``bz2``, ``br``, ``snappy``, optionally ``:LEVEL``.

Names, levels and defaults are those of mosaicml-streaming, so index.json files agree. Only
zstd, gz and bz2 are required; brotli and snappy are imported on first use and name the package
to install when missing. gzip output uses mtime 0 so our compressed shards are reproducible.

Decompression is always capped (:func:`decompress_to`): a shard comes from a store anyone with
write access may have filled, and 82 KB of zstd expand to 2.5 GiB, so decompressing it whole
before comparing its size with the index's would take gigabytes in every rank and DataLoader
worker that opens it. Output is produced a chunk at a time and refused past the size the index
gives, so memory stays at one chunk (and the codec's window) whatever the data claims.
"""

from __future__ import annotations

import bz2
import gzip
import importlib
import io
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import BinaryIO

from llmfoundry.utils.errors import MissingPackage, UserError

__all__ = [
    "compress",
    "decompress",
    "decompress_to",
    "extension",
    "is_compression",
    "parse_compression",
]

_CHUNK = 1 << 20  # decompressed bytes produced at a time
_INPUT_CHUNK = 1 << 16  # compressed bytes fed at a time to codecs that take input, not a file


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


def decompress(data: bytes, algo: str, max_size: int) -> bytes:
    """Decompress ``data``, at most ``max_size`` bytes of output (see :func:`decompress_to`)."""
    out = io.BytesIO()
    decompress_to(io.BytesIO(data), out, algo, max_size)
    return out.getvalue()


class _OverLimit(Exception):
    """The data declares more output than allowed (raised before producing it)."""


def decompress_to(src: BinaryIO, dst: BinaryIO, algo: str, max_size: int) -> int:
    """Decompress the file ``src`` into ``dst`` a chunk at a time; returns the bytes written.

    Raises ValueError as soon as the output would exceed ``max_size`` (having written at most
    ``max_size``), and ValueError naming the algorithm for corrupt input.
    """
    family, _ = parse_compression(algo)
    chunks = _chunks(family, _module(family), src, max_size)
    too_large = f"{family} data decompresses to more than {max_size} bytes"
    total = 0
    while True:
        try:
            chunk = next(chunks, None)
        except MemoryError:
            raise
        except _OverLimit:
            raise ValueError(too_large) from None
        except Exception as err:  # each library has its own error type (zstandard.ZstdError...)
            raise ValueError(f"corrupt {family} data: {err or type(err).__name__}") from err
        if chunk is None:
            return total
        total += len(chunk)
        if total > max_size:
            raise ValueError(too_large)
        dst.write(chunk)


def _chunks(family: str, mod: ModuleType, src: BinaryIO, max_size: int) -> Iterator[bytes]:
    """The decompressed bytes of ``src``, in chunks of about ``_CHUNK`` bytes."""
    if family == "zstd":
        # A frame's window is allocated before any output: cap it near the output size too (at
        # least 8 MiB, enough for every level's default window when the size is not recorded).
        window = min(max(max_size, 1 << 23), 1 << 31)
        decompressor = mod.ZstdDecompressor(max_window_size=window)
        # read_across_frames: shards may hold several frames, some without a content size.
        with decompressor.stream_reader(src, read_across_frames=True, closefd=False) as reader:
            while chunk := reader.read(_CHUNK):
                yield chunk
    elif family in ("gz", "bz2"):
        opened = gzip.GzipFile(fileobj=src) if family == "gz" else bz2.BZ2File(src)
        with opened as reader:
            while chunk := reader.read(_CHUNK):
                yield chunk
    elif family == "br":
        decompressor = mod.Decompressor()
        while block := src.read(_INPUT_CHUNK):
            yield decompressor.process(block, output_buffer_limit=_CHUNK)
            while not decompressor.can_accept_more_data():  # output held back by the limit
                yield decompressor.process(b"", output_buffer_limit=_CHUNK)
        if not decompressor.is_finished():
            raise ValueError("the brotli stream is truncated")
    else:  # snappy's raw format starts with the output size: check it before decompressing
        data = src.read()
        if _snappy_size(data) > max_size:
            raise _OverLimit
        yield mod.decompress(data)


def _snappy_size(data: bytes) -> int:
    """The uncompressed size a raw snappy block declares (a little-endian base-128 varint)."""
    size = 0
    for i, byte in enumerate(data[:5]):
        size |= (byte & 0x7F) << (7 * i)
        if byte < 0x80:
            return size
    raise ValueError("no valid size header")

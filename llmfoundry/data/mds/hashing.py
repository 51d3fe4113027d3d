"""Shard hashes, named as mosaicml-streaming names them in index.json.

hashlib algorithms (``sha1``, ``md5``, ``sha256``, ``sha3_256``, ``blake2b``...) and xxhash ones
(``xxh32``, ``xxh64``, ``xxh128``, ``xxh3_64``, ``xxh3_128``). The xxh family is ~10x faster and
is the right choice for integrity checks of large shards; the cryptographic ones exist for
compatibility with datasets that already list them.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterable
from typing import Any

import xxhash

from llmfoundry.utils.errors import UserError

__all__ = ["HASH_NAMES", "digest", "fastest", "file_digest", "is_hash"]

_HASHLIB = (
    "blake2b", "blake2s", "md5", "sha1", "sha224", "sha256", "sha384", "sha512",
    "sha3_224", "sha3_256", "sha3_384", "sha3_512",
)  # fmt: skip
_XXHASH = ("xxh32", "xxh64", "xxh128", "xxh3_64", "xxh3_128")

_CONSTRUCTORS: dict[str, Callable[[], Any]] = {
    **{name: getattr(hashlib, name) for name in _HASHLIB},
    **{name: getattr(xxhash, name) for name in _XXHASH},
}

#: Every supported hash name.
HASH_NAMES = frozenset(_CONSTRUCTORS)

# Fastest first (one core, 32 MiB in memory: the xxh family 6-25 GB/s, sha1 and sha256 with
# CPU instructions ~1.7 GB/s, md5 0.7, the rest below 0.5).
_BY_SPEED = (
    "xxh3_64", "xxh3_128", "xxh128", "xxh64", "xxh32", "sha1", "sha256", "sha224", "md5",
    "sha384", "sha512", "blake2b", "blake2s", "sha3_224", "sha3_256", "sha3_384", "sha3_512",
)  # fmt: skip


def is_hash(algo: str) -> bool:
    """Whether ``algo`` is a supported hash name."""
    return algo in _CONSTRUCTORS


def fastest(algos: Iterable[str]) -> str | None:
    """The fastest supported hash among ``algos`` (names an index lists), or None."""
    given = set(algos)
    return next((name for name in _BY_SPEED if name in given), None)


def _new(algo: str) -> Any:
    ctor = _CONSTRUCTORS.get(algo)
    if ctor is None:
        raise UserError(f"unknown hash {algo!r}; use one of {sorted(HASH_NAMES)}")
    return ctor()


def digest(algo: str, data: bytes | bytearray | memoryview) -> str:
    """Hex digest of ``data`` with ``algo``."""
    h = _new(algo)
    h.update(data)
    return h.hexdigest()


def file_digest(
    algos: list[str] | tuple[str, ...], path: str | os.PathLike, chunk: int = 1 << 22
) -> dict[str, str]:
    """Hex digests of a file for several algorithms in one streaming pass (bounded memory)."""
    hashers = {algo: _new(algo) for algo in algos}
    with open(path, "rb") as f:
        while block := f.read(chunk):
            for h in hashers.values():
                h.update(block)
    return {algo: h.hexdigest() for algo, h in hashers.items()}

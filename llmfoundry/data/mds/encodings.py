"""Column encodings of the MDS format: one value <-> bytes.

Each encoding name in an index.json (``"int"``, ``"str"``, ``"ndarray:uint16:2048"``...) maps to an
:class:`Encoding` through :func:`get_encoding`. The byte layouts follow FORMAT.md (beside this
file) exactly, because shards we write must be readable by mosaicml-streaming and the other way
round. Decoders take any bytes-like object (``bytes``, ``memoryview`` of an
mmap), so the reader can decode without copying when it wants a view.
"""

from __future__ import annotations

import io
import json
import pickle
from abc import ABC, abstractmethod
from decimal import Decimal
from functools import lru_cache
from typing import Any

import numpy as np

from llmfoundry.utils.errors import MissingPackage, UserError

__all__ = [
    "Encoding",
    "NDArray",
    "UnsafeEncodingError",
    "decode",
    "encode",
    "encoding_size",
    "get_encoding",
    "is_encoding",
    "ENCODING_NAMES",
]

Buffer = bytes | bytearray | memoryview


class UnsafeEncodingError(ValueError):
    """Raised when a shard column needs an unsafe decoder (pickle) that was not allowed."""


class Encoding(ABC):
    """Encodes one column value to bytes and back.

    ``size`` is the fixed byte size of every encoded value, or None when it varies (variable
    size columns carry a uint32 length in each sample's header).
    """

    name: str = ""
    size: int | None = None

    @abstractmethod
    def encode(self, obj: Any) -> bytes:
        """Encode ``obj`` to bytes."""

    @abstractmethod
    def decode(self, data: Buffer) -> Any:
        """Decode bytes produced by :meth:`encode`."""

    def _check_type(self, obj: Any, types: type | tuple[type, ...]) -> None:
        if not isinstance(obj, types):
            raise TypeError(
                f"encoding {self.name!r} expects {types}, got {type(obj).__name__}: {obj!r:.80}"
            )

    def _check_size(self, data: Buffer) -> None:
        if self.size is not None and len(data) != self.size:
            raise UserError(
                f"encoding {self.name!r} expects {self.size} bytes, got {len(data)} "
                "(corrupt shard or wrong column encoding)"
            )


class Bytes(Encoding):
    """Raw bytes, stored as is."""

    name = "bytes"

    def encode(self, obj: Any) -> bytes:
        self._check_type(obj, (bytes, bytearray, memoryview))
        return bytes(obj)

    def decode(self, data: Buffer) -> bytes:
        return bytes(data)


class Str(Encoding):
    """UTF-8 text."""

    name = "str"

    def encode(self, obj: Any) -> bytes:
        self._check_type(obj, str)
        return obj.encode("utf-8")

    def decode(self, data: Buffer) -> str:
        return bytes(data).decode("utf-8")


class Scalar(Encoding):
    """One numpy scalar, ``.tobytes()`` of its dtype (little-endian on every supported host)."""

    def __init__(self, name: str, dtype: str) -> None:
        self.name = name
        self.dtype = np.dtype(dtype)
        self.size = self.dtype.itemsize

    def encode(self, obj: Any) -> bytes:
        if isinstance(obj, bool) or not isinstance(obj, (int, float, np.number)):
            raise TypeError(f"encoding {self.name!r} expects a number, got {type(obj).__name__}")
        if self.dtype.kind in "iu":
            if not isinstance(obj, (int, np.integer)):
                raise TypeError(f"encoding {self.name!r} expects an integer, got {obj!r}")
            info = np.iinfo(self.dtype)
            if not info.min <= int(obj) <= info.max:
                raise ValueError(
                    f"{obj} does not fit encoding {self.name!r} "
                    f"(range {info.min}..{info.max}); choose a wider integer encoding"
                )
        return self.dtype.type(obj).tobytes()

    def decode(self, data: Buffer) -> Any:
        self._check_size(data)
        return np.frombuffer(data, self.dtype)[0]


class Int(Scalar):
    """Python int stored as int64; decodes to a Python int (as the reference library does)."""

    def __init__(self) -> None:
        super().__init__("int", "int64")

    def decode(self, data: Buffer) -> int:
        return int(super().decode(data))


class StrInt(Encoding):
    """Integer of any size as its decimal text."""

    name = "str_int"

    def encode(self, obj: Any) -> bytes:
        if isinstance(obj, bool):
            raise TypeError("encoding 'str_int' expects an int, got bool")
        self._check_type(obj, (int, np.integer))
        return str(int(obj)).encode("utf-8")

    def decode(self, data: Buffer) -> int:
        return int(bytes(data).decode("utf-8"))


class StrFloat(Encoding):
    """Float as its ``str()`` text (round-trips exactly)."""

    name = "str_float"

    def encode(self, obj: Any) -> bytes:
        self._check_type(obj, float)
        return str(obj).encode("utf-8")

    def decode(self, data: Buffer) -> float:
        return float(bytes(data).decode("utf-8"))


class StrDecimal(Encoding):
    """``decimal.Decimal`` as its text, keeping arbitrary precision."""

    name = "str_decimal"

    def encode(self, obj: Any) -> bytes:
        self._check_type(obj, Decimal)
        return str(obj).encode("utf-8")

    def decode(self, data: Buffer) -> Decimal:
        return Decimal(bytes(data).decode("utf-8"))


class JSON(Encoding):
    """Any JSON-serialisable object, ``json.dumps`` with default separators."""

    name = "json"

    def encode(self, obj: Any) -> bytes:
        if isinstance(obj, np.ndarray):
            obj = obj.tolist()
        try:
            return json.dumps(obj).encode("utf-8")
        except (TypeError, ValueError) as err:
            raise TypeError(f"encoding 'json' cannot serialise {obj!r:.80}: {err}") from err

    def decode(self, data: Buffer) -> Any:
        return json.loads(bytes(data).decode("utf-8"))


class Pickle(Encoding):
    """Arbitrary Python object as a pickle.

    Unpickling runs arbitrary code from the file, so decoding is refused unless the caller
    passed ``allow_unsafe=True`` explicitly (for shards it wrote itself or fully trusts).
    """

    name = "pkl"

    def __init__(self, allow_unsafe: bool = False) -> None:
        self.allow_unsafe = allow_unsafe

    def encode(self, obj: Any) -> bytes:
        return pickle.dumps(obj)

    def decode(self, data: Buffer) -> Any:
        if not self.allow_unsafe:
            raise UnsafeEncodingError(
                "column encoding 'pkl' (pickle) can execute arbitrary code when read; refusing. "
                "Only if you trust these shards, pass allow_unsafe=True to read them."
            )
        return pickle.loads(bytes(data))  # explicitly allowed by the caller


class NDArray(Encoding):
    """numpy array with a static or dynamic dtype and shape (four layouts, see FORMAT.md).

    Name forms: ``ndarray`` (both dynamic), ``ndarray:DTYPE`` (static dtype),
    ``ndarray:DTYPE:D0,D1`` (both static, fixed size), ``ndarray::D0,D1`` (static shape,
    dynamic dtype; the reference library cannot spell this last form in a name).
    """

    DTYPE_CODES = {
        "uint8": 8, "int8": 9, "uint16": 16, "int16": 17, "float16": 18, "uint32": 32,
        "int32": 33, "float32": 34, "uint64": 64, "int64": 65, "float64": 66,
    }  # fmt: skip
    CODE_DTYPES = {code: name for name, code in DTYPE_CODES.items()}
    SHAPE_DTYPES = ("uint8", "uint16", "uint32", "uint64")  # index = 2-bit shape code

    def __init__(self, dtype: str | None = None, shape: tuple[int, ...] | None = None) -> None:
        if dtype is not None and dtype not in self.DTYPE_CODES:
            raise UserError(
                f"unsupported ndarray dtype {dtype!r}; allowed: {sorted(self.DTYPE_CODES)}"
            )
        if shape is not None:
            if not shape or len(shape) > 63 or any(int(d) < 1 for d in shape):
                raise UserError(
                    f"ndarray shape {shape} must have 1..63 dimensions, each at least 1"
                )
            shape = tuple(int(d) for d in shape)
        self.dtype = dtype
        self.shape = shape
        self.size = (
            int(np.prod(shape)) * np.dtype(dtype).itemsize
            if dtype is not None and shape is not None
            else None
        )
        name = "ndarray"
        if dtype is not None or shape is not None:
            name += f":{dtype or ''}"
        if shape is not None:
            name += ":" + ",".join(map(str, shape))
        self.name = name

    @classmethod
    def from_args(cls, args: str) -> NDArray:
        """Parse the text after ``ndarray:`` (``"uint16:2048"``, ``"float32"``, ``":2,3"``)."""
        parts = args.split(":")
        if len(parts) > 2 or (len(parts) == 1 and not parts[0]):
            raise UserError(
                f"bad ndarray encoding 'ndarray:{args}'; use ndarray, ndarray:DTYPE or "
                "ndarray:DTYPE:D0,D1,..."
            )
        dtype = parts[0] or None
        shape = None
        if len(parts) == 2:
            try:
                shape = tuple(int(d) for d in parts[1].split(","))
            except ValueError:
                raise UserError(
                    f"bad ndarray shape {parts[1]!r} in 'ndarray:{args}'; use comma-separated "
                    "positive integers"
                ) from None
        return cls(dtype, shape)

    def encode(self, obj: Any) -> bytes:
        self._check_type(obj, np.ndarray)
        name = obj.dtype.name
        if name not in self.DTYPE_CODES:
            raise ValueError(
                f"ndarray dtype {name} cannot be stored; allowed: {sorted(self.DTYPE_CODES)}"
            )
        if obj.size == 0:
            raise ValueError("MDS cannot store an ndarray with zero elements")
        parts = []
        if self.dtype is None:
            parts.append(bytes([self.DTYPE_CODES[name]]))
        elif name != self.dtype:
            raise ValueError(f"encoding {self.name!r} expects dtype {self.dtype}, got {name}")
        if self.shape is None:
            if obj.ndim == 0 or obj.ndim > 63:
                raise ValueError(
                    f"ndarray must have 1..63 dimensions, got {obj.ndim} "
                    "(use a scalar encoding for 0-d values)"
                )
            largest = max(obj.shape)
            code = next(c for c, b in enumerate((8, 16, 32, 64)) if largest < (1 << b))
            parts.append(bytes([(obj.ndim << 2) | code]))
            parts.append(np.asarray(obj.shape, self.SHAPE_DTYPES[code]).tobytes())
        elif obj.shape != self.shape:
            raise ValueError(f"encoding {self.name!r} expects shape {self.shape}, got {obj.shape}")
        # The format is little-endian: a big-endian array ('>i4') is byte-swapped, not stored
        # as is (its raw bytes would decode to other values).
        parts.append(np.ascontiguousarray(obj, dtype=obj.dtype.newbyteorder("<")).tobytes())
        return b"".join(parts)

    def decode(self, data: Buffer) -> np.ndarray:
        """Decode to an array that views ``data`` (read-only when ``data`` is)."""
        view = memoryview(data).cast("B")
        pos = 0
        dtype = self.dtype
        if dtype is None:
            code = view[0]
            pos = 1
            dtype = self.CODE_DTYPES.get(code)
            if dtype is None:
                raise UserError(f"corrupt ndarray: unknown dtype code {code}")
        shape = self.shape
        if shape is None:
            head = view[pos]
            pos += 1
            ndim, code = head >> 2, head & 3
            shape_dtype = np.dtype(self.SHAPE_DTYPES[code])
            end = pos + ndim * shape_dtype.itemsize
            if ndim == 0 or end > len(view):
                raise UserError("corrupt ndarray: bad shape header")
            shape = tuple(int(d) for d in np.frombuffer(view[pos:end], shape_dtype))
            pos = end
        item = np.dtype(dtype)
        count = int(np.prod(shape))
        if len(view) - pos != count * item.itemsize:
            raise UserError(
                f"corrupt ndarray: {len(view) - pos} value bytes for shape {shape} of {dtype}"
            )
        return np.frombuffer(view, item, count=count, offset=pos).reshape(shape)


def _pil():
    try:
        from PIL import Image
    except ImportError:
        raise MissingPackage("image encodings need Pillow: pip install pillow") from None
    return Image


class PIL(Encoding):
    """PIL image, raw pixels: [width u32][height u32][mode length u32][mode][pixels]."""

    name = "pil"

    def encode(self, obj: Any) -> bytes:
        self._check_type(obj, _pil().Image)
        mode = obj.mode.encode("utf-8")
        head = np.array([obj.size[0], obj.size[1], len(mode)], np.uint32).tobytes()
        return head + mode + obj.tobytes()

    def decode(self, data: Buffer) -> Any:
        data = bytes(data)
        width, height, mode_len = (int(x) for x in np.frombuffer(data[:12], np.uint32))
        mode = data[12 : 12 + mode_len].decode("utf-8")
        return _pil().frombytes(mode, (width, height), data[12 + mode_len :])


class _SavedImage(Encoding):
    """PIL image saved in a file format (JPEG, PNG)."""

    format = ""

    def _save_args(self) -> dict[str, Any]:
        return {}

    def encode(self, obj: Any) -> bytes:
        self._check_type(obj, _pil().Image)
        original = self._original_bytes(obj)
        if original is not None:
            return original
        out = io.BytesIO()
        obj.save(out, format=self.format, **self._save_args())
        return out.getvalue()

    def _original_bytes(self, obj: Any) -> bytes | None:
        """The bytes of the file ``obj`` was opened from, when storing them loses nothing."""
        return None

    def decode(self, data: Buffer) -> Any:
        return _pil().open(io.BytesIO(bytes(data)))


class JPEG(_SavedImage):
    """JPEG image; ``jpeg:Q`` sets the quality (default 75).

    An image opened from a JPEG file is stored as that file's bytes, as the reference library
    does: re-encoding would lose quality a second time. Other images are encoded at ``Q``.
    """

    format = "JPEG"

    def __init__(self, quality: int = 75) -> None:
        if not 0 <= quality <= 100:
            raise UserError(f"jpeg quality must be 0..100, got {quality}")
        self.quality = quality
        self.name = "jpeg" if quality == 75 else f"jpeg:{quality}"

    def _save_args(self) -> dict[str, Any]:
        return {"quality": self.quality}

    def _original_bytes(self, obj: Any) -> bytes | None:
        from PIL.JpegImagePlugin import JpegImageFile

        if isinstance(obj, JpegImageFile) and getattr(obj, "filename", ""):
            with open(obj.filename, "rb") as f:
                return f.read()
        return None


class PNG(_SavedImage):
    """PNG image (lossless)."""

    name = "png"
    format = "PNG"


_SCALARS = (
    "uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64",
    "float16", "float32", "float64",
)  # fmt: skip
_SIMPLE: dict[str, type[Encoding]] = {
    "bytes": Bytes, "str": Str, "int": Int, "str_int": StrInt, "str_float": StrFloat,
    "str_decimal": StrDecimal, "json": JSON, "pil": PIL, "png": PNG,
}  # fmt: skip

#: Every encoding family name (the text before the first ``:``).
ENCODING_NAMES = frozenset((*_SIMPLE, *_SCALARS, "ndarray", "jpeg", "pkl"))


@lru_cache(maxsize=256)
def _parse(name: str) -> Encoding:
    family, sep, args = name.partition(":")
    if family == "ndarray":
        return NDArray.from_args(args) if sep else NDArray()
    if family == "jpeg" and sep:
        try:
            return JPEG(int(args))
        except ValueError:
            raise UserError(f"bad jpeg encoding {name!r}; use jpeg or jpeg:QUALITY") from None
    if sep:
        raise UserError(f"encoding {family!r} takes no arguments, got {name!r}")
    if family in _SCALARS:
        return Scalar(family, family)
    if family == "jpeg":
        return JPEG()
    if family in _SIMPLE:
        return _SIMPLE[family]()
    if family.startswith("list["):
        raise UserError(f"list image encodings ({name!r}) are not supported")
    raise UserError(f"unknown MDS encoding {name!r}; known: {sorted(ENCODING_NAMES)}")


def get_encoding(name: str, allow_unsafe: bool = False) -> Encoding:
    """The coder for an encoding name; ``pkl`` decodes only with ``allow_unsafe=True``."""
    if not isinstance(name, str):
        raise TypeError(f"encoding name must be a str, got {type(name).__name__}")
    if name == "pkl":
        return Pickle(allow_unsafe)
    return _parse(name)


def is_encoding(name: str) -> bool:
    """Whether ``name`` is a valid encoding name."""
    try:
        get_encoding(name)
    except (ValueError, TypeError):
        return False
    return True


def encoding_size(name: str) -> int | None:
    """Fixed byte size of every value of this encoding, or None when it varies."""
    return get_encoding(name).size


def encode(name: str, obj: Any) -> bytes:
    """Encode one value with the named encoding."""
    return get_encoding(name).encode(obj)


def decode(name: str, data: Buffer, allow_unsafe: bool = False) -> Any:
    """Decode one value with the named encoding."""
    return get_encoding(name, allow_unsafe).decode(data)

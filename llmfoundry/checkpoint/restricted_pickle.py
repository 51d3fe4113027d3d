"""Reading pickled checkpoints of other programs (Composer's) without running code from them.

A Composer checkpoint is a ``torch.save`` zip whose pickle holds, besides tensors, a few objects
of other classes: numpy's RNG state array, ``datetime.timedelta`` wall-clock times, the torch
version as a ``TorchVersion``. ``torch.load(weights_only=True)`` refuses those, and
``weights_only=False`` would call whatever the pickle names, so a planted ``os.system`` would run
on load. `load` reads the file through torch with `RestrictedUnpickler`, which resolves only the
names in `ALLOWED_GLOBALS` (found in real Composer 0.32 checkpoints, see
tests/fixtures/foundry/PICKLE_GLOBALS.txt) and refuses any other in one line naming it. Each
allowed name resolves to something that builds data and runs no code of the file's: numpy's
array rebuild, a timedelta, ``str`` for ``TorchVersion`` (a str subclass; plain data here).

Memory is bounded before torch parses anything: the zip's entries must be stored, not
compressed (torch writes them so; a compressed entry could expand without limit), and its
pickle is at most `MAX_PICKLE_BYTES` (tensors live in separate entries, read at their stored
size; a Composer pickle of a 7B model's state is a few MB).
"""

from __future__ import annotations

import _compat_pickle
import codecs
import collections
import datetime
import io
import pickle
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from llmfoundry.checkpoint.manifest import CheckpointError, describe

MAX_PICKLE_BYTES = 256 * 2**20


def _numpy_reconstruct() -> Callable[..., Any]:
    """numpy's array rebuild, under numpy 2's name or 1's."""
    core = getattr(np, "_core", None) or np.core
    return core.multiarray._reconstruct


# `module.name` -> what it resolves to. Torch's storages (`torch.FloatStorage`, ...) never reach
# `find_class`: torch's own unpickler wrapper resolves names containing "Storage" first.
ALLOWED_GLOBALS: dict[str, Callable[[], Any]] = {
    "collections.OrderedDict": lambda: collections.OrderedDict,
    "datetime.timedelta": lambda: datetime.timedelta,
    "_codecs.encode": lambda: codecs.encode,  # bytes in a protocol-2 pickle (numpy's buffers)
    "numpy.ndarray": lambda: np.ndarray,
    "numpy.dtype": lambda: np.dtype,
    "numpy._core.multiarray._reconstruct": _numpy_reconstruct,  # written by numpy 2
    "numpy.core.multiarray._reconstruct": _numpy_reconstruct,  # written by numpy 1
    "torch._utils._rebuild_tensor_v2": lambda: torch._utils._rebuild_tensor_v2,
    "torch.torch_version.TorchVersion": lambda: str,
}


class RefusedGlobal(pickle.UnpicklingError):
    """The pickle names a global outside `ALLOWED_GLOBALS` (what a payload does)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


class RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that resolves only `ALLOWED_GLOBALS`."""

    def find_class(self, module: str, name: str) -> Any:
        # Python 2 names (torch.save writes protocol 2), mapped as pickle's own find_class does.
        module, name = _compat_pickle.NAME_MAPPING.get((module, name), (module, name))
        module = _compat_pickle.IMPORT_MAPPING.get(module, module)
        resolve = ALLOWED_GLOBALS.get(f"{module}.{name}")
        if resolve is None:
            raise RefusedGlobal(f"{module}.{name}")
        return resolve()


class _PickleModule:
    """What ``torch.load(pickle_module=)`` takes: a module-like object with `Unpickler`/`load`."""

    Unpickler = RestrictedUnpickler
    __name__ = __name__

    @staticmethod
    def load(file: Any, **kwargs: Any) -> Any:
        return RestrictedUnpickler(file, **kwargs).load()


def refusal(url: str, name: str) -> CheckpointError:
    return CheckpointError(
        f"refusing to load {url}: it needs {name}, which a checkpoint does not hold; loading it "
        "could run code written into the file: load a checkpoint from a source you trust"
    )


def check_archive(path: Path | io.BytesIO, url: str) -> None:
    """Refuse a torch zip whose entries could expand memory beyond its size (see the module
    docstring); raises CheckpointError naming `url`."""
    try:
        with zipfile.ZipFile(path) as archive:
            entries = archive.infolist()
    except (zipfile.BadZipFile, OSError) as err:
        raise CheckpointError(
            f"cannot read {url}: not a torch zip file ({describe(err)})"
        ) from None
    for entry in entries:
        if entry.compress_type != zipfile.ZIP_STORED:
            raise CheckpointError(
                f"refusing to load {url}: its entry {entry.filename} is compressed, which torch "
                "never writes; save the checkpoint again with torch.save"
            )
        if entry.filename.endswith("data.pkl") and entry.file_size > MAX_PICKLE_BYTES:
            raise CheckpointError(
                f"refusing to load {url}: its pickle is {entry.file_size:,} bytes, more than "
                f"the {MAX_PICKLE_BYTES:,} a checkpoint's state needs"
            )


def load(path: Path) -> Any:
    """The object ``torch.save`` wrote to the local file `path`, read with `RestrictedUnpickler`
    (tensors on the CPU, memory-mapped rather than read)."""
    check_archive(path, str(path))
    try:
        return torch.load(
            path, map_location="cpu", pickle_module=_PickleModule, weights_only=False, mmap=True
        )
    except RefusedGlobal as err:
        raise refusal(str(path), err.name) from None
    except Exception as err:  # noqa: BLE001 - damaged bytes, whatever torch raises
        raise CheckpointError(f"cannot read {path}: {describe(err)}; the file is damaged") from None


def loads(data: bytes, url: str) -> Any:
    """`load` for an object ``torch.save`` wrote into bytes (a DCP shard's non-tensor value)."""
    check_archive(io.BytesIO(data), url)
    try:
        return torch.load(
            io.BytesIO(data), map_location="cpu", pickle_module=_PickleModule, weights_only=False
        )
    except RefusedGlobal as err:
        raise refusal(url, err.name) from None

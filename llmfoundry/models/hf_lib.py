"""transformers, imported without torchao: the one place our code imports it from.

transformers' quantizers import torchao at import time whenever it is installed (as it is for
precision=amp_fp8), which costs seconds and prints four lines of warnings (CUDA kernels that do
not load, deprecated pytree registrations) before every script that reads or writes a
transformers folder. We load no torchao-quantized checkpoint, so transformers is told torchao is
absent (its availability check is cached: it stays so for this process); torchao itself is
imported only where float8 training asks for it (`llmfoundry.models.converters`). If torchao was
already imported (float8 in this process), transformers sees it as it is.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from types import ModuleType

__all__ = ["transformers"]


@contextlib.contextmanager
def _torchao_hidden() -> Iterator[None]:
    """`importlib.util.find_spec('torchao')` (transformers' check) finds nothing meanwhile."""
    if "torchao" in sys.modules:
        yield
        return
    sys.modules["torchao"] = None  # type: ignore[assignment]  # the import system's "absent"
    try:
        yield
    finally:
        del sys.modules["torchao"]


def _import_transformers() -> ModuleType:
    with _torchao_hidden():
        import transformers
        import transformers.modeling_utils  # noqa: F401  (the quantizers, torchao's importer)

    return transformers


transformers = _import_transformers()

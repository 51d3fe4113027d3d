"""The one door to object stores: every remote read and write opens its filesystem here.

Endpoints, credentials profiles and other fsspec options are configured once per process with
:func:`configure` and then reach every caller (data, tokenizers, checkpoints, data_prep), so an
``s3://`` URL never silently talks to a different endpoint in one place than in another.
Options merge in this order, later winning:

1. fsspec's own configuration, applied by fsspec itself: ``FSSPEC_<PROTOCOL>_<KEY>``
   environment variables and ``~/.config/fsspec`` files (plus what the backend reads itself,
   e.g. s3fs/boto's ``AWS_ENDPOINT_URL``, ``AWS_PROFILE``);
2. the ``options`` given to :func:`configure`, for every remote URL (never for local paths);
3. ``overrides[prefix]`` for URLs starting with ``prefix`` (longer prefixes win), e.g.
   ``{"s3://other-bucket/": {"profile": "other"}}``;
4. options the caller passes for this one URL (e.g. ``data.storage_options``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import fsspec

__all__ = ["configure", "is_local", "local_path", "open_url", "options_for", "url_to_fs"]

_options: dict[str, Any] = {}
_overrides: dict[str, dict[str, Any]] = {}


def configure(
    options: Mapping[str, Any] | None = None,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
) -> None:
    """Set the fsspec options every remote URL of this process gets (replaces earlier ones)."""
    if options is not None and not isinstance(options, Mapping):
        raise ValueError(f"storage options must be a mapping of fsspec options, got {options!r}")
    for prefix, extra in (overrides or {}).items():
        if "://" not in prefix or not isinstance(extra, Mapping):
            raise ValueError(
                f"storage override {prefix!r} must map a URL prefix like 's3://bucket/' to a "
                "mapping of fsspec options"
            )
    _options.clear()
    _options.update(options or {})
    _overrides.clear()
    _overrides.update({p: dict(o) for p, o in (overrides or {}).items()})


def is_local(url: str) -> bool:
    """Whether ``url`` is a path on this machine (no scheme, or ``file://``)."""
    return fsspec.utils.get_protocol(url) in ("file", "local")


def local_path(url: str) -> str:
    """The filesystem path of a local URL (``file:///data/x`` -> ``/data/x``)."""
    return fsspec.core.strip_protocol(url) if "://" in url else url


def options_for(url: str, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The fsspec options :func:`url_to_fs` uses for ``url`` (see the module docstring)."""
    merged: dict[str, Any] = {}
    if not is_local(url):
        merged.update(_options)
        for prefix in sorted(_overrides, key=len):
            if url.startswith(prefix):
                merged.update(_overrides[prefix])
    merged.update(extra or {})
    return merged


def url_to_fs(url: str, **extra: Any) -> tuple[fsspec.AbstractFileSystem, str]:
    """The filesystem holding ``url`` and the path on it, with the configured options."""
    return fsspec.core.url_to_fs(url, **options_for(url, extra))


def open_url(url: str, mode: str = "rb", **kwargs: Any) -> Any:
    """``fsspec.open`` with the configured options (a context manager giving a file object).

    ``kwargs`` may mix file arguments (``encoding``) and filesystem options, as fsspec allows.
    """
    return fsspec.open(url, mode, **options_for(url, kwargs))

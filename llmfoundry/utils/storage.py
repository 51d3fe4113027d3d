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

The training config's ``storage:`` block and the data_prep scripts' ``--storage`` flag hold the
same settings, ``{options: {...}, overrides: {prefix: {...}}}``, applied with
:func:`configure_settings`. Credentials belong in the environment, a profile or fsspec's config
files, never in these settings on a command line (shells and experiment trackers keep it).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import stat
import uuid
from collections.abc import Iterator, Mapping
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem
from omegaconf import OmegaConf

from llmfoundry.utils.errors import UserError
from llmfoundry.utils.files import join_url
from llmfoundry.utils.secrets import redact_urls

__all__ = [
    "configure",
    "configure_settings",
    "endpoint",
    "falling_back_to",
    "is_local",
    "is_unreachable",
    "load_settings",
    "local_path",
    "open_url",
    "options_for",
    "parse_settings",
    "probe_writable",
    "read_small",
    "url_to_fs",
]
SETTINGS_KEYS = ("options", "overrides")

_options: dict[str, Any] = {}
_overrides: dict[str, dict[str, Any]] = {}


def configure(
    options: Mapping[str, Any] | None = None,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
) -> None:
    """Set the fsspec options every remote URL of this process gets (replaces earlier ones)."""
    if options is not None and not isinstance(options, Mapping):
        raise UserError(f"storage options must be a mapping of fsspec options, got {options!r}")
    for prefix, extra in (overrides or {}).items():
        if "://" not in prefix or not isinstance(extra, Mapping):
            raise UserError(
                f"storage override {prefix!r} must map a URL prefix like 's3://bucket/' to a "
                "mapping of fsspec options"
            )
    _options.clear()
    _options.update(options or {})
    _overrides.clear()
    _overrides.update({p: dict(o) for p, o in (overrides or {}).items()})


def parse_settings(
    settings: Mapping[str, Any] | None,
) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """``(options, overrides)`` of a ``storage:`` block; null options are left unset.

    Raises ValueError naming the bad key, so a config check can report it before the run.
    """
    settings = settings or {}
    if not isinstance(settings, Mapping):
        raise UserError(f"storage: expected {{options: ..., overrides: ...}}, got {settings!r}")
    unknown = sorted(set(settings) - set(SETTINGS_KEYS))
    if unknown:
        raise UserError(
            f"storage.{unknown[0]}: unknown key; allowed: options (fsspec options for every "
            "remote URL), overrides (options by URL prefix)"
        )
    options, overrides = settings.get("options") or {}, settings.get("overrides") or {}
    if not isinstance(options, Mapping):
        raise UserError(f"storage.options: expected a mapping of fsspec options, got {options!r}")
    if not isinstance(overrides, Mapping):
        raise UserError(
            "storage.overrides: expected {'s3://bucket/': {option: value}}, got " + repr(overrides)
        )
    for prefix, extra in overrides.items():
        if "://" not in str(prefix) or not isinstance(extra, Mapping):
            raise UserError(
                f"storage.overrides: {prefix!r} must map a URL prefix like 's3://bucket/' to a "
                "mapping of fsspec options"
            )

    def unset_nulls(values: Mapping[str, Any]) -> dict[str, Any]:
        return {str(k): v for k, v in values.items() if v is not None}

    return unset_nulls(options), {str(p): unset_nulls(o) for p, o in overrides.items()}


def configure_settings(settings: Mapping[str, Any] | None) -> None:
    """Apply a ``storage:`` block (see :func:`parse_settings`) to this process."""
    configure(*parse_settings(settings))


@contextlib.contextmanager
def falling_back_to(settings: Mapping[str, Any] | None) -> Iterator[None]:
    """Within the block, a ``storage:`` block fills in what this process's settings leave unset
    (option by option, for every remote URL and per override prefix); the process's own settings
    again afterwards. For reading what another run wrote with its own settings (its
    saved config's endpoint) while a ``--storage`` given here still wins."""
    options, overrides = parse_settings(settings)
    before = dict(_options), {prefix: dict(extra) for prefix, extra in _overrides.items()}
    merged = {
        prefix: {**overrides.get(prefix, {}), **before[1].get(prefix, {})}
        for prefix in {*overrides, *before[1]}
    }
    configure({**options, **before[0]}, merged)
    try:
        yield
    finally:
        configure(*before)


def load_settings(spec: str) -> dict[str, Any]:
    """Storage settings from a YAML/JSON file, or given inline: ``'{options: {profile: r2}}'``.

    Raises UserError (a ValueError) naming the problem: scripts report it as one line."""
    text = open(spec, encoding="utf-8").read() if os.path.isfile(spec) else spec
    try:
        settings = OmegaConf.to_container(OmegaConf.create(text), resolve=True)
    except Exception as err:  # YAML syntax errors of any kind
        message = " ".join(str(err).split())
        raise UserError(
            f"--storage {spec!r}: not a YAML/JSON file or mapping ({message})"
        ) from None
    if not isinstance(settings, Mapping):
        raise UserError(
            f"--storage {spec!r}: expected a file or a mapping such as "
            "'{options: {endpoint_url: http://localhost:9000}}'"
        )
    try:
        parse_settings(settings)
    except ValueError as err:
        raise UserError(f"--storage {spec!r}: {err}") from None
    return dict(settings)


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


# What picks the server a URL is read from, as opposed to credentials: fsspec options at any depth
# (``client_kwargs.endpoint_url``) and the environment variables the backends read themselves.
_ENDPOINT_OPTIONS = frozenset(
    ("endpoint_url", "endpoint", "host", "port", "account_name", "account_url", "profile")
)
_ENDPOINT_ENV = (
    "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "STORAGE_EMULATOR_HOST",
    "AZURE_STORAGE_ACCOUNT_NAME",
)  # fmt: skip


def endpoint(url: str, extra: Mapping[str, Any] | None = None) -> dict[str, str]:
    """The settings that choose which server ``url`` is read from (credentials left out), from
    fsspec's configuration, :func:`options_for` and the environment: ``s3://bucket/x`` on two
    S3-compatible servers are two datasets, and a cache must tell them apart."""
    if is_local(url):
        return {}
    found: dict[str, str] = {}

    def collect(options: Mapping[str, Any], prefix: str = "") -> None:
        for key, value in options.items():
            if isinstance(value, Mapping):
                collect(value, f"{prefix}{key}.")
            elif key in _ENDPOINT_OPTIONS and value is not None:
                found[prefix + key] = str(value)

    collect(fsspec.config.conf.get(fsspec.utils.get_protocol(url), {}))
    collect(options_for(url, extra))
    found.update({f"${name}": os.environ[name] for name in _ENDPOINT_ENV if os.environ.get(name)})
    return found


def url_to_fs(url: str, **extra: Any) -> tuple[fsspec.AbstractFileSystem, str]:
    """The filesystem holding ``url`` and the path on it, with the configured options."""
    _refuse_credentials(url)
    return fsspec.core.url_to_fs(url, **options_for(url, extra))


def open_url(url: str, mode: str = "rb", **kwargs: Any) -> Any:
    """``fsspec.open`` with the configured options (a context manager giving a file object).

    ``kwargs`` may mix file arguments (``encoding``) and filesystem options, as fsspec allows.
    """
    _refuse_credentials(url)
    return fsspec.open(url, mode, **options_for(url, kwargs))


def read_small(url: str, limit: int, **options: Any) -> bytes:
    """The bytes of the small file `url` (a status file, a ``latest`` pointer, a saved config),
    read from folders other processes or users write; `options`: filesystem options for a URL
    beside the configured ones (a dataset's own ``storage_options``).

    Raises `UserError` for a file larger than `limit` (read no further than that) and, on this
    machine, for what is not a regular file: a FIFO would block the reader forever, a link to
    /dev/zero fill its memory. FileNotFoundError when there is nothing at `url`.
    """
    if is_local(url):
        path = local_path(url)
        # Non-blocking: a FIFO opens at once instead of waiting for a writer.
        with os.fdopen(os.open(path, os.O_RDONLY | os.O_NONBLOCK), "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise UserError(f"{url} is not a regular file; remove it or replace it by one")
            data = f.read(limit + 1)
    else:
        with open_url(url, "rb", **options) as f:
            data = f.read(limit + 1)
    if len(data) > limit:
        raise UserError(f"{url} is larger than {limit:,} bytes, more than such a file holds")
    return data


# Object stores whose URLs never carry credentials: ``s3://KEY:SECRET@bucket/x`` is read as a
# bucket named "KEY:SECRET@bucket", and the secret ends up in every error and log line.
_BUCKET_SCHEMES = ("s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oci", "r2")


def _refuse_credentials(url: str) -> None:
    scheme, sep, rest = str(url).partition("://")
    if sep and scheme.lower() in _BUCKET_SCHEMES and "@" in rest.split("/", 1)[0]:
        raise UserError(
            f"{redact_urls(url)} holds credentials before its bucket, which {scheme}:// URLs do "
            "not take (and every log would show): put them in the environment (e.g. "
            "AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY), a credentials profile "
            "(storage.options.profile) or fsspec's config, and give the URL without them"
        )


# The fix for a read that `is_unreachable`, in messages that name the URL.
UNREACHABLE_FIX = (
    "check the URL, the network, and the storage settings (storage.options.endpoint_url, the "
    "credentials)"
)


def is_unreachable(err: BaseException) -> bool:
    """Whether `err` is a store or web server that did not answer, or answered with an error
    status (a refused connection, an unknown host, a timeout, a denied request), as opposed to
    a path that is not there (`FileNotFoundError`, which callers report themselves) or a bug."""
    if isinstance(err, FileNotFoundError):
        return False
    return isinstance(err, (OSError, *_backend_errors()))


@functools.cache
def _backend_errors() -> tuple[type[BaseException], ...]:
    """The base classes of the errors of the backends fsspec's object stores and HTTP use
    (boto for s3://, aiohttp for http(s):// and gs://), those installed."""
    found: list[type[BaseException]] = []
    for module, names in (
        ("botocore.exceptions", ("BotoCoreError", "ClientError")),
        ("aiohttp", ("ClientError",)),
    ):
        try:
            imported = importlib.import_module(module)
        except ImportError:
            continue
        found += [getattr(imported, name) for name in names]
    return tuple(found)


def probe_writable(folder: str, what: str, fix: str, error: type[UserError] = UserError) -> None:
    """Write and delete a small object in `folder`, so a destination that cannot be written fails
    in the first second of a job instead of after its work (a missing bucket, credentials, an
    endpoint). Raises `error`: one line naming `what` (e.g. "save_folder"), the folder, the
    backend's first line, and `fix`; a missing bucket is named with how to create it."""
    fs, root = url_to_fs(folder)
    probe = join_url(root, f".write-probe-{uuid.uuid4().hex[:12]}")
    try:
        if isinstance(fs, LocalFileSystem):  # (on object stores makedirs may create a bucket)
            fs.makedirs(root, exist_ok=True)
        fs.pipe_file(probe, b"llmfoundry write probe\n")
        fs.rm(probe)
    except Exception as err:  # noqa: BLE001 - any backend's error means the same to the user
        first_line = (str(err).splitlines() or [""])[0]
        scheme, _, path = folder.partition("://")
        if path and "bucket does not exist" in first_line.lower():
            bucket = path.split("/")[0]
            fix = (
                f"create it first (e.g. `aws s3 mb {scheme}://{bucket}`, with --endpoint-url for "
                f"an S3-compatible store), or {fix}"
            )
            first_line = f"bucket {bucket!r} does not exist"
        raise error(
            f"{what} {folder} is not writable ({type(err).__name__}: {first_line}); {fix}"
        ) from None

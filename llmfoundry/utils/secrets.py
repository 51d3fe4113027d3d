"""Credentials removed from everything a run writes: trackers, metrics files, logs, saved configs.

Configs and command lines carry credentials next to the recipe (``storage_options.key``,
``hf_token``, ``s3://user:password@host/...``); trackers keep what they are sent forever and
share it with a team. One policy, applied everywhere we write:

- a config key whose name contains one of `SECRET_WORDS` (any case) is dropped, with
  everything under it. This is deliberately broad: losing ``tokenizer`` from a dashboard is
  cheap, leaking a key is not;
- the user-info part of a URL (``scheme://user:password@``) is replaced by `REDACTED`;
- in a command-line argument (a Hydra override, possibly an inline mapping) the value of a
  secret-named ``name=value`` or ``name: value`` pair is replaced by `REDACTED`.

Log lines only get the URL rule (:func:`redact_urls`): metric names such as ``tokens/sec`` are
not secrets.

The supported ways to pass credentials are the environment (``AWS_ACCESS_KEY_ID``, ...), a
credentials profile (``storage.options.profile``) or fsspec's config files, never the command
line: shells keep history, and process listings show it to every user of the machine.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "REDACTED",
    "SECRET_WORDS",
    "is_secret",
    "redact_argv",
    "redact_secrets",
    "redact_text",
    "redact_urls",
]

SECRET_WORDS = ("key", "token", "secret", "password", "passwd", "credential")
REDACTED = "<redacted>"
_WORDS = "|".join(SECRET_WORDS)
# scheme://user[:password]@  ->  scheme://<redacted>@
_USERINFO = re.compile(r"(?P<scheme>\b[a-zA-Z][a-zA-Z0-9+.\-]*://)[^/@\s'\"]+@")
# name=value or name: value where the name (a dotted override key or a mapping key) is secret.
_PAIR = re.compile(
    rf"(?P<name>[\w.\-]*(?:{_WORDS})[\w.\-]*['\"]?)(?P<sep>\s*[=:]\s*)(?P<value>'[^']*'|\"[^\"]*\"|[^\s,}}\]]+)",
    re.IGNORECASE,
)


def is_secret(name: str) -> bool:
    lowered = name.lower()
    return any(word in lowered for word in SECRET_WORDS)


def redact_urls(text: str) -> str:
    """``text`` with the user-info of every URL in it hidden."""
    return _USERINFO.sub(lambda m: f"{m['scheme']}{REDACTED}@", text)


def redact_text(text: str) -> str:
    """``text`` with URL user-info and secret-named ``name=value`` / ``name: value`` hidden."""
    return _PAIR.sub(lambda m: f"{m['name']}{m['sep']}{REDACTED}", redact_urls(text))


def redact_secrets(config: Any) -> Any:
    """A copy of ``config`` (nested mappings and lists) without secret-named keys, its strings
    redacted by :func:`redact_text` (Hydra keeps overrides as strings); the input is not
    modified."""
    if isinstance(config, Mapping):
        return {k: redact_secrets(v) for k, v in config.items() if not is_secret(str(k))}
    if isinstance(config, list | tuple):
        return [redact_secrets(v) for v in config]
    if isinstance(config, str):
        return redact_text(config)
    return config


def redact_argv(argv: Sequence[str]) -> list[str]:
    """Command-line arguments as they may be recorded (Hydra overrides, flags and their values).

    A value following a secret-named flag (``--token abc``) is hidden too.
    """
    out: list[str] = []
    hide_next = False
    for arg in argv:
        if hide_next:
            out.append(REDACTED)
            hide_next = False
            continue
        flag = arg.startswith("-") and "=" not in arg
        hide_next = flag and is_secret(arg.lstrip("-"))
        out.append(arg if flag else redact_text(arg))
    return out

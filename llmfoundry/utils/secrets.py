"""Credentials removed from everything a run writes: trackers, metrics files, logs, saved configs.

Configs and command lines carry credentials next to the recipe (``storage_options.key``,
``hf_token``, ``s3://user:password@host/...``); trackers keep what they are sent forever and
share it with a team. One policy, applied everywhere we write:

- a config key whose name is a secret's (`is_secret`) is dropped, with everything under it:
  one with a word holding one of `SECRET_WORDS` (``db_password``, ``aws_secret_access_key``,
  ``storage_options.secret``) or a compound ending in token or key (``hftoken``), or ending in
  a token or key (``hf_token``, ``WANDB_API_KEY``,
  ``AWS_ACCESS_KEY_ID``, ``storage_options.key``, ``apiKey``) unless the word before says it is
  a token of text or a key of a mapping (``eos_token``, ``sort_key``: `NOT_SECRET_BEFORE`).
  Plurals (``max_tokens``, ``load_ignore_keys``) are counts and lists of names, secret only
  after a secret's kind (``api_keys``, ``ssh_keys``), and ``tokenizer`` is not a token. A
  name it does not know ends up hidden, never shown: losing a setting from a dashboard is
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
    "name_words",
    "redact_argv",
    "redact_secrets",
    "redact_text",
    "redact_urls",
]

# Parts of words that make a name a secret's wherever they are in it (``db_password``,
# ``clientSecret``, ``gcp_credentials``).
SECRET_WORDS = (
    "secret", "password", "passwd", "passphrase", "credential", "apikey", "authorization",
    "bearer",
)  # fmt: skip
# A final token or key is a secret's unless the word before it is one of these.
NOT_SECRET_BEFORE = {
    "token": {
        "eos", "bos", "pad", "unk", "sep", "cls", "mask", "special", "added", "start", "end",
        "stop", "eot", "image", "max", "min", "num", "n", "per", "first", "last", "next",
        "prompt", "new", "single", "vocab", "loss",
    },
    "key": {
        "sort", "dict", "cache", "batch", "label", "labels", "input", "output", "text", "prompt",
        "response", "group", "partition", "hash", "primary", "foreign", "lookup", "metric",
        "monitor", "column", "field", "full", "parent", "sample", "data", "state", "config",
    },
}  # fmt: skip
# Secrets' kinds: after them even a plural (``api_keys``, ``hf_tokens``) is secret.
SECRET_KINDS = {
    "api", "access", "auth", "bearer", "private", "ssh", "hf", "wandb", "session", "refresh",
    "github", "gh", "oauth", "client", "secret",
}  # fmt: skip
REDACTED = "<redacted>"
# scheme://user[:password]@  ->  scheme://<redacted>@
_USERINFO = re.compile(r"(?P<scheme>\b[a-zA-Z][a-zA-Z0-9+.\-]*://)[^/@\s'\"]+@")
# name=value or name: value (a dotted override key or a mapping key); hidden where the name is
# a secret's.
_PAIR = re.compile(
    r"(?P<name>[\w.\-]+['\"]?)(?P<sep>\s*[=:]\s*)(?P<value>'[^']*'|\"[^\"]*\"|[^\s,}\]]+)"
)
# Word boundaries in a name: separators, and camelCase humps (apiKey, accessToken).
_SEPARATORS = re.compile(r"[^a-zA-Z0-9]+|(?<=[a-z0-9])(?=[A-Z])")


def name_words(name: str) -> list[str]:
    """The lower-case words of a name: ``data.storage_options.apiKey`` -> data, storage,
    options, api, key."""
    return [word.lower() for word in _SEPARATORS.split(name) if word]


def is_secret(name: str) -> bool:
    """Whether a config key, override key or variable name is a secret's (module docstring)."""
    words = name_words(name)
    if any(part in word for word in words for part in SECRET_WORDS):
        return True
    # A compound word ending in token or key (hftoken, accesskey); tokenizer does not.
    if any(word.endswith(("token", "key")) and word not in NOT_SECRET_BEFORE for word in words):
        return True
    if len(words) > 1 and words[-1] in ("id", "ids") and words[-2] == "key":
        words = words[:-1]  # AWS_ACCESS_KEY_ID: named for the key it goes with
    if not words:
        return False
    last, before = words[-1], words[-2] if len(words) > 1 else None
    if last in NOT_SECRET_BEFORE:
        return before not in NOT_SECRET_BEFORE[last]
    plural = last.removesuffix("s")
    return plural in NOT_SECRET_BEFORE and last != plural and before in SECRET_KINDS


def redact_urls(text: str) -> str:
    """``text`` with the user-info of every URL in it hidden."""
    return _USERINFO.sub(lambda m: f"{m['scheme']}{REDACTED}@", text)


def redact_text(text: str) -> str:
    """``text`` with URL user-info and secret-named ``name=value`` / ``name: value`` hidden."""

    def hide(pair: re.Match[str]) -> str:
        if not is_secret(pair["name"].strip("'\"")):
            return pair[0]
        return f"{pair['name']}{pair['sep']}{REDACTED}"

    return _PAIR.sub(hide, redact_urls(text))


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

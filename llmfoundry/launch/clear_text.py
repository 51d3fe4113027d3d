"""What a job may not write in clear into the script and manifest it renders: secret-named
values and URLs with credentials, in setup lines and an llm-foundry config. The job file
(`job.py`) and an MCLI run file's mapping onto it (`mcli.py`) both check with these, so they
live below both."""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping
from typing import Any

from llmfoundry.utils.errors import UserError
from llmfoundry.utils.secrets import is_secret, name_words, redact_urls

# A URL's user-info, anywhere in a value: scheme://user[:password]@host (group 1: the scheme,
# 2: the user-info).
_USERINFO = re.compile(r"\b([a-zA-Z][a-zA-Z0-9+.-]*)://([^/@\s'\"]*)@")
# A training override whose value is read from the environment when the run starts.
FROM_ENV = re.compile(r"\$\{oc\.env:[A-Za-z_][A-Za-z0-9_]*(,[^}]*)?\}\Z")


def url_credentials(text: str) -> bool:
    """Whether a URL in `text` carries a password or token: ``postgres://user:pw@``, or over
    HTTP(S) any user-info at all (``https://ghp_x@github.com``: a token alone reads as a user
    name). A plain user name (``ssh://git@host``, ``postgres://me@db/x``) is not a secret."""
    return any(
        ":" in userinfo or scheme.lower().rsplit("+", 1)[-1] in ("http", "https")
        for scheme, userinfo in _USERINFO.findall(text)
    )


def secret_named(key: str) -> bool:
    """Whether an override key (``+storage.options.secret``) or variable name is a secret's:
    WANDB_API_KEY, HF_TOKEN, AWS_SECRET_ACCESS_KEY; not TOKENIZERS_PARALLELISM."""
    key = key.lstrip("+~")
    return is_secret(key) or "pat" in name_words(key)  # (and GitHub's personal access tokens)


def check_setup_line(line: str) -> None:
    """A setup line is rendered in clear like everything else: a secret-named assignment or
    flag given a value (``export HF_TOKEN=hf_x``, ``--token hf_x``) or a URL with credentials is
    refused, naming `secrets:`. Values read from the environment (``--token "$HF_TOKEN"``) pass."""
    try:
        words = shlex.split(line, comments=True)
    except ValueError:  # (unbalanced quotes: bash reports it where it runs)
        words = line.split()
    for word, following in zip(words, [*words[1:], ""], strict=True):
        name, equals, value = word.partition("=")
        flag = not equals and name.startswith("-")
        if (equals or flag) and secret_named(name.lstrip("-")):
            value = following if flag else value
            if value and not value.startswith(("$", "-")):
                raise UserError(
                    f"setup: a line gives {name.lstrip('-')} a value, which would be written in "
                    "clear into the rendered script and manifest; list an environment variable "
                    'under secrets: and use it there ("$NAME")'
                )
    if url_credentials(line):
        raise UserError(
            f"setup: {redact_urls(line)[:80]!r} holds credentials in a URL, which would be "
            "written in clear into the rendered script and manifest; give them through "
            "secrets: (environment variables) instead"
        )


def check_foundry_config(config: Any, path: str = "foundry_config") -> None:
    """An llm-foundry config is shipped in clear inside the rendered script and manifest: a
    secret-named key holding a value, or a URL with credentials, is refused; read the value
    from the environment instead (``${oc.env:NAME}``, NAME listed under secrets:)."""
    if isinstance(config, Mapping):
        for key, value in config.items():
            check_foundry_config(value, f"{path}.{key}")
    elif isinstance(config, list):
        for index, value in enumerate(config):
            check_foundry_config(value, f"{path}.{index}")
    elif isinstance(config, str):
        if url_credentials(config):
            raise UserError(
                f"{path}: {redact_urls(config)!r} holds credentials in a URL, which would be "
                "written in clear into the rendered script and manifest; give the URL without "
                "them and the credentials through secrets: (e.g. AWS_ACCESS_KEY_ID, "
                "AWS_SECRET_ACCESS_KEY)"
            )
        if secret_named(path) and not FROM_ENV.match(config):
            raise UserError(
                f"{path}: named like a secret, and the config is written in clear into the "
                f"rendered script and manifest; list an environment variable under secrets: "
                "and read it: '${oc.env:NAME}'"
            )

"""The run's config as hyperparameters for experiment trackers, with credentials removed.

Configs carry credentials (``storage_options.key``, ``hf_token``, ``aws_secret_access_key``) next
to the recipe; trackers keep what they are sent forever and share it with a team. Any key whose
name contains one of `SECRET_WORDS` (any case) is dropped, with everything under it. This is
deliberately broad: losing ``tokenizer`` from a dashboard is cheap, leaking a key is not.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

SECRET_WORDS = ("key", "token", "secret", "password")


def is_secret(name: str) -> bool:
    lowered = name.lower()
    return any(word in lowered for word in SECRET_WORDS)


def redact_secrets(config: Any) -> Any:
    """A copy of `config` (nested dicts and lists) without secret-named keys."""
    if isinstance(config, Mapping):
        return {k: redact_secrets(v) for k, v in config.items() if not is_secret(str(k))}
    if isinstance(config, list | tuple):
        return [redact_secrets(v) for v in config]
    return config

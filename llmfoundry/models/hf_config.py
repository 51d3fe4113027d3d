"""A transformers folder's config.json, read as untrusted input: bounded in size, and its sizes
checked before transformers or our model divide by them.

A folder from anywhere can say ``num_attention_heads: 0`` (a ZeroDivisionError deep in
transformers), leave ``hidden_size`` out (transformers fills in its own default, so the import
would build a model other than the one the weights were trained for) or be a 50 MB file; each is
a one-line :class:`UserError` here, naming the file, the key and the fix.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from llmfoundry.utils.errors import MissingInput, UserError

__all__ = ["CONFIG_FILE", "MAX_CONFIG_BYTES", "check_sizes", "read_config_json"]

CONFIG_FILE = "config.json"
# Real configs are a few KB; this bounds what reading one may cost.
MAX_CONFIG_BYTES = 1 << 20
_REFETCH = "fix it or export / download the folder again"


def read_config_json(hf_dir: str | Path) -> dict[str, Any]:
    """The JSON object in `hf_dir`/config.json; UserError if absent, too large or not one."""
    path = Path(hf_dir, CONFIG_FILE)
    if not path.is_file():
        raise MissingInput(f"{hf_dir} is not a transformers model folder (no {CONFIG_FILE})")
    size = path.stat().st_size
    if size > MAX_CONFIG_BYTES:
        raise UserError(
            f"{path}: {size} bytes, more than a transformers config.json holds (at most "
            f"{MAX_CONFIG_BYTES}); {_REFETCH}"
        )
    try:
        raw = json.loads(path.read_bytes())
    except (OSError, ValueError) as err:
        raise UserError(
            f"{path}: not a readable transformers config.json ({err}); {_REFETCH}"
        ) from None
    if not isinstance(raw, dict):
        raise UserError(f"{path}: not a transformers config.json (a JSON object); {_REFETCH}")
    return raw


def check_sizes(
    hf_dir: str | Path, raw: dict[str, Any], required: Iterable[str], optional: Iterable[str] = ()
) -> None:
    """Every `required` key of config `raw` is there and a positive integer, every `optional`
    one is absent, null or a positive integer."""
    path = Path(hf_dir, CONFIG_FILE)
    for key in required:
        if key not in raw:
            raise UserError(f"{path} has no {key!r}; {_REFETCH}")
    for key in (*required, *optional):
        value = raw.get(key)
        if value is None and key not in required:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise UserError(f"{path}: {key}={value!r}, not a positive integer; {_REFETCH}")

"""What an llm-foundry train YAML becomes here: group choices and values of our config.

One `Native` is rendered two ways that compose to the same config: the Hydra overrides
`scripts/train.py` runs with (`overrides`), and an experiment file (`experiment_yaml`) that
`train.py +experiment=NAME` selects, for users who move over for good.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import yaml

# Strings Hydra's override grammar reads back as the same string without quotes.
_PLAIN = re.compile(r"^[\w./-]+$")


class Whole(dict):
    """A mapping set as one value (``data.streams={...}``), not key by key: its keys are
    names the composed config does not have yet."""


@dataclass
class Prep:
    """An input made before the run (not by `--cfg job`): `kind` "import_hf" imports the
    transformers folder `source` as a weights-only checkpoint in `target`; "instructions"
    converts the .jsonl `source` to instruction MDS rows in `target`."""

    kind: str
    source: str
    target: str
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class Native:
    """`groups`: conf/ group choices (``model: mpt-tiny``, ``callbacks: [lr_monitor]``);
    `values`: our keys, nested; `notes`: their keys that need no counterpart here, one line
    each saying why; `prep`: inputs to make before the run."""

    groups: dict[str, str | list[str]] = field(default_factory=dict)
    values: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    prep: list[Prep] = field(default_factory=list)

    def set(self, key: str, value: Any) -> None:
        """Set our dotted `key` (``model.d_model``) to `value`."""
        *parents, last = key.split(".")
        node = self.values
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value

    def get(self, key: str, default: Any = None) -> Any:
        node: Any = self.values
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                return default
            node = node[part]
        return node

    def note(self, key: str, why: str) -> None:
        self.notes.append(f"{key}: {why}")

    def overrides(self) -> list[str]:
        """Hydra command-line overrides: group choices first, then every value's leaf."""
        out = [f"{group}={_choice(choice)}" for group, choice in self.groups.items()]
        return out + [f"{key}={_literal(value)}" for key, value in _leaves(self.values)]

    def experiment_yaml(self, source: str) -> str:
        """A conf/experiment file (``# @package _global_``) with the same config."""
        defaults = [{f"override /{group}": choice} for group, choice in self.groups.items()]
        body = yaml.safe_dump(
            {"defaults": defaults, **_plain(self.values)}, sort_keys=False, width=100
        )
        notes = "".join(f"#   {line}\n" for line in self.notes)
        steps = "".join(f"#   {describe(step)}\n" for step in self.prep)
        return (
            "# @package _global_\n"
            f"# Translated from the llm-foundry train config {source} (scripts/from_foundry.py).\n"
            + (f"# Make these inputs first:\n{steps}" if steps else "")
            + (f"# Their keys with no counterpart needed here:\n{notes}" if notes else "")
            + body
        )


def describe(step: Prep) -> str:
    """The command that makes `step`'s input by hand."""
    if step.kind == "import_hf":
        return f"python scripts/import_hf.py {step.source} {step.target}"
    options = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in step.options.items())
    return f"python data_prep/instructions_to_mds.py {step.source} {options} --out {step.target}"


def _leaves(values: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    out = []
    for key, value in values.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and not isinstance(value, Whole) and value:
            out += _leaves(value, f"{dotted}.")
        else:
            out.append((dotted, value))
    return out


def _plain(value: Any) -> Any:
    """`value` with `Whole` mappings as plain dicts (for yaml.safe_dump)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _choice(choice: str | list[str]) -> str:
    """A group choice: an option name, or a list of them (``callbacks=[lr_monitor]``)."""
    return choice if isinstance(choice, str) else "[" + ",".join(choice) + "]"


def _reads_as_other(text: str) -> bool:
    """Whether Hydra would read unquoted `text` as a number, bool or null."""
    try:
        float(text)
        return True
    except ValueError:
        return text.lower() in ("true", "false", "null", "nan", "inf")


def _literal(value: Any) -> str:
    """`value` in Hydra's override grammar: strings quoted (interpolations stay live)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        if _PLAIN.match(value) and not _reads_as_other(value):
            return value
        return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
    if isinstance(value, list):
        return "[" + ",".join(_literal(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_literal(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"no override literal for {type(value).__name__}")

"""The run folder's copy of the config: Hydra's ``.hydra/`` files, without credentials.

Hydra would save the composed config, its own config and the command-line overrides as plain
YAML readable by every user of the machine, secrets included (``data.storage_options.secret=...``
on the command line lands in all three). ``conf/train.yaml`` turns Hydra's own saving off
(``hydra.output_subdir: null``) and ``scripts/train.py`` writes the same three files here instead:
redacted (`llmfoundry.utils.secrets`) and owner-only (mode 0600) from their first byte, and only
once the run holds the run folder's lock (``build_trainer(write_run_files=...)``), so a launch
refused because another run holds the folder leaves that run's files untouched.

A sweep's ``multirun.yaml`` (the whole config, written by Hydra's sweeper before the first job)
has no off switch: every job rewrites it redacted and owner-only as it writes its own files
(`redact_multirun_config`), so it holds credentials only until the first job starts. And
``--cfg`` prints the config as it would be saved (`redacted_yaml`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from llmfoundry.utils.files import atomic_write
from llmfoundry.utils.secrets import redact_secrets, redact_text
from llmfoundry.utils.yaml_guard import safe_load

__all__ = [
    "CONFIG_DIR",
    "FILE_MODE",
    "redact_multirun_config",
    "redacted_yaml",
    "write_run_config",
]

CONFIG_DIR = ".hydra"  # where Hydra's tools (and users) look for a run's config
MULTIRUN_FILE = "multirun.yaml"  # Hydra's sweeper writes it in the sweep folder
FILE_MODE = 0o600


def write_run_config(
    run_dir: str | Path, cfg: DictConfig, hydra_cfg: DictConfig, overrides: Sequence[str]
) -> Path:
    """Write config.yaml, hydra.yaml and overrides.yaml into ``run_dir/.hydra``; return it."""
    folder = Path(run_dir) / CONFIG_DIR
    files: dict[str, Any] = {
        "config.yaml": OmegaConf.to_container(cfg, resolve=False),
        "hydra.yaml": {"hydra": OmegaConf.to_container(hydra_cfg, resolve=False)},
        "overrides.yaml": list(overrides),
    }
    for name, content in files.items():
        _write_private(folder / name, OmegaConf.to_yaml(OmegaConf.create(redact_secrets(content))))
    if hydra_cfg.get("mode") == RunMode.MULTIRUN:
        redact_multirun_config(Path(hydra_cfg.sweep.dir) / MULTIRUN_FILE)
    return folder


def redact_multirun_config(path: Path) -> None:
    """Rewrite a sweep's ``multirun.yaml`` without secrets, owner-only (jobs of a sweep may do
    this at the same time: each writes the same text, atomically)."""
    if path.is_file():
        _write_private(path, redacted_yaml(path.read_text(encoding="utf-8")))


def redacted_yaml(text: str) -> str:
    """YAML text (a config as Hydra prints or saves it) without secret-named keys and with URL
    credentials hidden, by the policy of the saved config; a scalar by `redact_text`."""
    content = safe_load(text)
    if not isinstance(content, dict | list):
        return redact_text(text)
    return OmegaConf.to_yaml(OmegaConf.create(redact_secrets(content)))


def _write_private(path: Path, text: str) -> None:
    def write(tmp: Path) -> None:
        tmp.touch(mode=FILE_MODE)
        tmp.chmod(FILE_MODE)  # whatever the umask
        tmp.write_text(text, encoding="utf-8")

    atomic_write(path, write)

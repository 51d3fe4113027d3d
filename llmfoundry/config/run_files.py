"""The run folder's copy of the config: Hydra's ``.hydra/`` files, without credentials.

Hydra would save the composed config, its own config and the command-line overrides as plain
YAML readable by every user of the machine, secrets included (``data.storage_options.secret=...``
on the command line lands in all three). ``conf/train.yaml`` turns Hydra's own saving off
(``hydra.output_subdir: null``) and ``scripts/train.py`` writes the same three files here instead:
redacted (`llmfoundry.utils.secrets`) and owner-only (mode 0600) from their first byte, and only
once the run holds the run folder's lock (``build_trainer(write_run_files=...)``), so a launch
refused because another run holds the folder leaves that run's files untouched.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from llmfoundry.utils.files import atomic_write
from llmfoundry.utils.secrets import redact_secrets

__all__ = ["CONFIG_DIR", "FILE_MODE", "write_run_config"]

CONFIG_DIR = ".hydra"  # where Hydra's tools (and users) look for a run's config
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
        text = OmegaConf.to_yaml(OmegaConf.create(redact_secrets(content)))

        def write(tmp: Path, text: str = text) -> None:
            tmp.touch(mode=FILE_MODE)
            tmp.chmod(FILE_MODE)  # whatever the umask
            tmp.write_text(text, encoding="utf-8")

        atomic_write(folder / name, write)
    return folder

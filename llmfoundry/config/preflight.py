"""Compose and validate the config before Hydra starts the run, and report problems in one line.

Hydra's own message for a misspelt override (``model.n_layer=2``) suggests appending the key
with ``+``, which only moves the error; here it becomes "model.n_layer: unknown key; did you mean
'n_layers'? allowed: ...". Runs in well under a second.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from hydra.utils import get_object
from omegaconf import DictConfig, OmegaConf

from llmfoundry.config.parallelism import ALIASES
from llmfoundry.config.schema import HYDRA_KEYS, ConfigError, suggest, target_schema
from llmfoundry.config.static_schema import static_schema
from llmfoundry.config.train_config import register_resolvers, validate_config
from llmfoundry.utils.errors import exit_on_user_error

# Hydra command-line flags after which composing the plain overrides is not meaningful.
_SKIP_FLAGS = {
    "-m",
    "--multirun",
    "-h",
    "--help",
    "--hydra-help",
    "-i",
    "--info",
    "--shell-completion",
    "-sc",
}
_OVERRIDE_KEY = re.compile(r"Could not (?:override|append to|delete from config\.) '([^']+)'")
# Hydra's message for an option a group does not have (`converters=[float9]`): several lines.
_GROUP_OPTION = re.compile(r"Could not (?:find|load) '([\w-]+)/([^']+?)'")


def compose_config(
    config_dir: Path, overrides: Sequence[str], config_name: str = "train"
) -> DictConfig:
    register_resolvers()
    with initialize_config_dir(str(config_dir), version_base="1.3"):
        return compose(config_name, overrides=list(overrides))


def check(config_dir: Path, overrides: Sequence[str], config_name: str = "train") -> None:
    """Raise ConfigError describing the first problem with these overrides."""
    try:
        cfg = compose_config(config_dir, overrides, config_name)
    except HydraException as err:
        raise _explain(err, config_dir, overrides, config_name) from None
    validate_config(cfg)


def _explain(
    err: HydraException, config_dir: Path, overrides: Sequence[str], config_name: str
) -> ConfigError:
    if option := _GROUP_OPTION.search(str(err)):
        group, name = option.groups()
        options = sorted(p.stem for p in (config_dir / group).glob("*.yaml"))
        return ConfigError(group, f"no option '{name}'; {suggest(name, options)}")
    match = _OVERRIDE_KEY.search(str(err))
    if not match:
        return ConfigError("", str(err).strip())
    key = match.group(1)
    parent_key, _, name = key.rpartition(".")
    rest = [o for o in overrides if not o.lstrip("+~").startswith(f"{key}=")]
    try:
        root = compose_config(config_dir, rest, config_name)
        parent = OmegaConf.select(root, parent_key) if parent_key else root
    except HydraException:
        parent = None
    if not isinstance(parent, DictConfig):
        return ConfigError(key, str(err).strip().splitlines()[0])
    allowed = {str(k) for k in parent.keys()} - HYDRA_KEYS
    if "_target_" in parent:  # from the source if it can be read: torch is not imported yet
        schema = static_schema(parent["_target_"])
        hints = schema.hints if schema else target_schema(get_object(parent["_target_"]))[0]
        allowed |= set(hints)
    # The strategy group's old mesh keys (only FSDP's config keeps them, as aliases): DDP and
    # DeepSpeed hold whole models, and the mesh is the parallelism block's.
    if parent_key == "strategy" and name in ALIASES:
        kind = {"tp": "tensor", "cp": "context", "replicate": "hybrid sharded data"}
        return ConfigError(
            key,
            f"{kind.get(name, 'pipeline')} parallelism runs on strategy=fsdp, and the mesh is "
            f"parallelism.{ALIASES[name]} now (strategy=fsdp parallelism.{ALIASES[name]}=...)",
        )
    return ConfigError(key, f"unknown key; {suggest(name, sorted(allowed))}")


def preflight(
    argv: Sequence[str], config_dir: Path, config_name: str = "train", debug: bool = False
) -> None:
    """Exit with status 2 and one message when the command line's config is invalid.

    ``debug``: raise the ConfigError instead (its traceback shown).
    """
    if any(arg in _SKIP_FLAGS or arg.startswith("--cfg") or arg == "-c" for arg in argv):
        return
    overrides = [
        a for a in argv if not a.startswith("-") and not a.lstrip("+~").startswith("hydra.")
    ]
    with exit_on_user_error(debug, prefix="Config error"):
        check(config_dir, overrides, config_name)

"""Config: top-level settings, run naming, and validation of a composed Hydra config."""

from llmfoundry.config.check import register_resolvers, validate_config
from llmfoundry.config.run_name import default_run_name
from llmfoundry.config.settings import GROUPS, TrainSettings
from llmfoundry.config.validate import ConfigError, check_keys, check_type

__all__ = [
    "GROUPS",
    "ConfigError",
    "TrainSettings",
    "check_keys",
    "check_type",
    "default_run_name",
    "register_resolvers",
    "validate_config",
]

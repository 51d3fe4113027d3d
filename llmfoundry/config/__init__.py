"""Config: top-level settings, run naming, and validation of a composed Hydra config."""

from llmfoundry.config.run_name import default_run_name
from llmfoundry.config.schema import ConfigError, check_keys, check_type
from llmfoundry.config.settings import GROUPS, TrainSettings
from llmfoundry.config.train_config import register_resolvers, validate_config

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

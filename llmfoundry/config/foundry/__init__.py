"""llm-foundry train YAMLs run here: `load` reads one as llm-foundry does, `translate` maps it
onto our config (`Native`: Hydra overrides or a conf/experiment file), refusing in one line
what we cannot honour. scripts/train.py takes such a YAML as its first argument;
scripts/from_foundry.py prints or writes the translation."""

from llmfoundry.config.foundry.native import Native, Prep, describe
from llmfoundry.config.foundry.translate import PREP_ROOT, load, translate

__all__ = ["PREP_ROOT", "Native", "Prep", "describe", "load", "translate"]

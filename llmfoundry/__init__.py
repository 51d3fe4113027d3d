"""llmfoundry: LLM pretraining recipes (MPT models, MDS streaming data, an event-driven trainer)."""

from llmfoundry.utils.yaml_guard import guard_omegaconf

__version__ = "0.1.0"

# Before any config is read: OmegaConf and Hydra refuse YAML whose aliases would expand it.
guard_omegaconf()

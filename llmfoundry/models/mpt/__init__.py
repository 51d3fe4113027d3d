"""MPT decoder-only language model: config, model and Hugging Face export."""

from llmfoundry.models.mpt.config import InfiniConfig, MPTConfig
from llmfoundry.models.mpt.model import MPTForCausalLM

__all__ = ["InfiniConfig", "MPTConfig", "MPTForCausalLM"]

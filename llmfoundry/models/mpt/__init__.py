"""MPT decoder-only language model: config, model and Hugging Face export."""

from llmfoundry.models.mpt.config import MPTConfig
from llmfoundry.models.mpt.model import MPTForCausalLM

__all__ = ["MPTConfig", "MPTForCausalLM"]

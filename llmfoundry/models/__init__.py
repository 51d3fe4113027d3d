"""Model definitions. Each knows nothing of the trainer or of parallelism."""

from llmfoundry.models.mpt import MPTConfig, MPTForCausalLM

__all__ = ["MPTConfig", "MPTForCausalLM"]

"""Mixtral mixture-of-experts decoder (Mixtral-8x7B architecture): config, model and HF adapters."""

from llmfoundry.models.mixtral.config import PRESETS, MixtralConfig
from llmfoundry.models.mixtral.model import MixtralForCausalLM

__all__ = ["PRESETS", "MixtralConfig", "MixtralForCausalLM"]

"""Llama decoder-only language model (Llama 2/3 architecture): config, model and HF adapters."""

from llmfoundry.models.llama.config import PRESETS, LlamaConfig, RopeScaling
from llmfoundry.models.llama.model import LlamaForCausalLM

__all__ = ["PRESETS", "LlamaConfig", "LlamaForCausalLM", "RopeScaling"]

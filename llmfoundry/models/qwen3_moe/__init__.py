"""Qwen3-MoE mixture-of-experts decoder (Qwen3-30B-A3B architecture): config, model and HF
adapters."""

from llmfoundry.models.qwen3_moe.config import PRESETS, Qwen3MoeConfig
from llmfoundry.models.qwen3_moe.model import Qwen3MoeForCausalLM

__all__ = ["PRESETS", "Qwen3MoeConfig", "Qwen3MoeForCausalLM"]

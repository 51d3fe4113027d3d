"""Qwen's dense decoders, Qwen3 and Qwen2 (Qwen3 is Qwen2 with per-head q/k norms, its own head
width and no biases): configs, models and the transformers adapter, one package as the two
differ by a few spec fields."""

from llmfoundry.models.qwen3.config import PRESETS, Qwen2Config, Qwen3Config
from llmfoundry.models.qwen3.model import Qwen2ForCausalLM, Qwen3ForCausalLM

__all__ = ["PRESETS", "Qwen2Config", "Qwen2ForCausalLM", "Qwen3Config", "Qwen3ForCausalLM"]

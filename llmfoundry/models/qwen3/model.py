"""Qwen3 and Qwen2 models: the shared decoder (models/layers/decoder.py) of their configs' specs;
nothing is their own but the class, by which `family_of` finds a model's family."""

from __future__ import annotations

from llmfoundry.models.layers.decoder import DecoderLM


class Qwen3ForCausalLM(DecoderLM):
    """A Qwen3 dense decoder (`Qwen3Config`): per-head RMSNorm on queries and keys before RoPE,
    heads `head_dim` wide, no biases."""


class Qwen2ForCausalLM(DecoderLM):
    """A Qwen2 / Qwen2.5 decoder (`Qwen2Config`): Llama's with biases on q, k and v."""

"""Qwen3-MoE: the shared decoder (`llmfoundry.models.layers.decoder`) as
`Qwen3MoeConfig.decoder_spec` makes it: Qwen3's blocks (per-head q/k norms) with the
mixture-of-experts layer (`llmfoundry.models.layers.moe`) as every block's feed-forward."""

from __future__ import annotations

from llmfoundry.models.layers.decoder import DecoderLM
from llmfoundry.models.qwen3_moe.config import Qwen3MoeConfig


class Qwen3MoeForCausalLM(DecoderLM):
    """A Qwen3-MoE causal language model; its class names the family (`family_of`)."""

    config: Qwen3MoeConfig

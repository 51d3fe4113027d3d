"""Mixtral: the shared decoder (`llmfoundry.models.layers.decoder`) as `MixtralConfig.decoder_spec`
makes it: Llama's blocks with the mixture-of-experts layer (`llmfoundry.models.layers.moe`) as
every block's feed-forward."""

from __future__ import annotations

from llmfoundry.models.layers.decoder import DecoderLM
from llmfoundry.models.mixtral.config import MixtralConfig


class MixtralForCausalLM(DecoderLM):
    """A Mixtral causal language model; its class names the family (`family_of`)."""

    config: MixtralConfig

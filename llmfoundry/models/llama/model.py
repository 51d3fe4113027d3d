"""Llama: the shared decoder (llmfoundry/models/layers/decoder.py) with RoPE, grouped-query
attention, SwiGLU and RMSNorm, as `LlamaConfig.decoder_spec` spells out."""

from __future__ import annotations

from llmfoundry.models.layers.decoder import DecoderLM
from llmfoundry.models.llama.config import LlamaConfig


class LlamaForCausalLM(DecoderLM):
    """Llama with its output head: `lm_head`, or the token embedding if `tie_word_embeddings`.

    Nothing here is Llama's own beyond its config: q_proj, k_proj, v_proj (transformers'
    layout, renamed by `hf.py`), no biases, N(0, init_std) init, and a causal bias cache of at
    most `decoder.MASK_CACHE_LEN` positions (Llama 3.1's max_seq_len is 131072)."""

    config: LlamaConfig

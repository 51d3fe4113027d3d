"""MPT: the shared decoder (llmfoundry/models/layers/decoder.py) as `MPTConfig.decoder_spec`
spells it out: ALiBi (or RoPE, or a learned table), a fused Wqkv, tied embeddings and
pre-LayerNorm blocks by default. Parameter names follow transformers' MptForCausalLM
(`transformer.blocks.0.attn.Wqkv.weight`, ...), so exporting is a state dict copy."""

from __future__ import annotations

import torch
from torch import nn

from llmfoundry.models.layers.decoder import DecoderLM
from llmfoundry.models.mpt.config import MPTConfig
from llmfoundry.models.mpt.infini import InfiniAttention


class MPTForCausalLM(DecoderLM):
    """MPT with its output head: the token embedding (logits = h @ wte.weight^T), or its own
    `lm_head` with `tie_word_embeddings=false`.

    MPT's own: infini-attention (`cfg.infini`: every block's attention is an
    `InfiniAttention`, whose kernel runs on segments, so no kernel product is prepared from the
    forward's lengths; its gates start at `gate_init`; local attention spans one segment in the
    flop count)."""

    config: MPTConfig

    def __init__(self, config: MPTConfig) -> None:
        super().__init__(config)
        if config.infini is not None:
            self.transformer.masks.prepare = None

    def make_attention(self) -> nn.Module:
        if self.config.infini is None:
            return super().make_attention()
        return InfiniAttention(self.spec, self.config.infini)

    def flops_per_token(self, seq_len: int) -> int:
        """`DecoderLM.flops_per_token`, over one segment with infini-attention, whose memory
        costs O(head_dim^2) per token, not O(seq_len)."""
        if self.config.infini is not None:
            seq_len = min(seq_len, self.config.infini.segment_len)
        return super().flops_per_token(seq_len)

    @torch.no_grad()
    def init_weights(self) -> None:
        super().init_weights()
        if self.config.infini is not None:
            for block in self.transformer.blocks:
                block.attn.gate.fill_(self.config.infini.gate_init)

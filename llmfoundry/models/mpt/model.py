"""MPT: a decoder-only transformer with ALiBi, tied embeddings and pre-LayerNorm blocks.

Read top to bottom: Attention, Block, MPTModel (embeddings, blocks, final norm),
MPTForCausalLM (output head, tied by default; loss, flops, init). What llm-foundry's MPT offers
beside that is shared with other families: LayerNorm and RMSNorm, with their low-precision
option (`llmfoundry/models/norms.py`), the MLP and its gated form (`models/layers/ffn.py`),
RoPE (`models/layers/position.py`).
Decoding with a KV cache (`models/layers/kv_cache.py`) and sampling live in
`models/generation.py`.
Parameter names follow transformers' MptForCausalLM (`transformer.blocks.0.attn.Wqkv.weight`, ...)
so exporting is a state dict copy. The model knows nothing of parallelism or of the trainer.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from llmfoundry.core.loss import next_token_loss
from llmfoundry.models.layers.attention import AttentionMask, AttentionMasks, compute_dtype
from llmfoundry.models.layers.ffn import GLU, MLP
from llmfoundry.models.layers.kernels import ATTN_IMPLS, PREPARE
from llmfoundry.models.layers.kv_cache import InfiniState, Keys, LayerKV, attend_over
from llmfoundry.models.layers.position import (
    ALiBi,
    LinearRopeScaling,
    RotaryEmbedding,
    apply_rope,
    token_positions,
)
from llmfoundry.models.mpt.config import MPTConfig
from llmfoundry.models.mpt.infini import infini_attention, infini_attention_step
from llmfoundry.models.norms import LayerNorm, build_norm
from llmfoundry.utils.errors import UserError

# RoPE's (cos, sin) of each position, [batch or 1, seq, head_dim] (`RotaryEmbedding`).
Rope = tuple[torch.Tensor, torch.Tensor]


class Attention(nn.Module):
    """Causal self-attention with a fused QKV projection and grouped key/value heads.

    `Wqkv` projects to n_heads query heads and kv_n_heads key and value heads (MPT's fused
    layout: [q | k | v]). `clip_qkv` clamps that projection (a guard against loss spikes);
    `qk_ln` normalises queries and keys over their full width before they are split into heads
    (with a LayerNorm, also when the blocks' `norm_type` is rmsnorm: llm-foundry's does);
    with RoPE, `project` then rotates each head's queries and keys (llm-foundry's order).
    `forward` is `project` then `attend`: a caller with a cache of past keys and values can run
    `project` on the new tokens, extend k and v, and `attend` with the mask of all positions.
    The head counts are read from the projection's width, not the config, so the same code runs
    a `Wqkv` that computes [q | k | v] for a subset of the heads (a tensor-parallel rank's).
    """

    def __init__(self, cfg: MPTConfig) -> None:
        super().__init__()
        self.n_heads, self.kv_n_heads = cfg.n_heads, cfg.kv_n_heads
        self.head_dim = cfg.d_model // cfg.n_heads
        self.softmax_scale = cfg.softmax_scale or 1.0 / math.sqrt(self.head_dim)
        self.clip_qkv = cfg.clip_qkv
        self.qk_ln = cfg.qk_ln
        self.attn_pdrop = cfg.attn_pdrop
        self.attn_fn = ATTN_IMPLS[cfg.attn_impl]
        kv_dim = self.kv_n_heads * self.head_dim
        self.Wqkv = nn.Linear(cfg.d_model, cfg.d_model + 2 * kv_dim, bias=not cfg.no_bias)
        if cfg.qk_ln:
            # LayerNorm whatever norm_type says: llm-foundry's blocks never pass theirs down.
            self.q_ln = LayerNorm(cfg.d_model, not cfg.no_bias, cfg.low_precision_layernorm)
            self.k_ln = LayerNorm(kv_dim, not cfg.no_bias, cfg.low_precision_layernorm)
        self.out_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=not cfg.no_bias)

    def project(
        self, x: torch.Tensor, rope: Rope | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [B, n_heads, L, head_dim] and k, v [B, kv_n_heads, L, head_dim] for `x` [B, L, d];
        q and k rotated by `rope` if given."""
        batch, seq_len, _ = x.shape
        qkv = self.Wqkv(x)
        if self.clip_qkv is not None:
            qkv = qkv.clamp(min=-self.clip_qkv, max=self.clip_qkv)
        kv_dim = qkv.shape[-1] * self.kv_n_heads // (self.n_heads + 2 * self.kv_n_heads)
        q, k, v = qkv.split([qkv.shape[-1] - 2 * kv_dim, kv_dim, kv_dim], dim=-1)
        if self.qk_ln:
            q, k = self.q_ln(q), self.k_ln(k)
        q = q.view(batch, seq_len, -1, self.head_dim).transpose(1, 2)
        k = k.view(batch, seq_len, -1, self.head_dim).transpose(1, 2)
        v = v.view(batch, seq_len, -1, self.head_dim).transpose(1, 2)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        return q, k, v

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask
    ) -> torch.Tensor:
        """`kernel` on q, k, v (queries are the last of the key positions), then out_proj."""
        y = self.kernel(q, k, v, mask)
        batch, _, q_len, _ = q.shape
        return self.out_proj(y.transpose(1, 2).reshape(batch, q_len, -1))

    def kernel(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask
    ) -> torch.Tensor:
        """Each head's attention output [B, n_heads, q_len, head_dim] (`attn_impl`'s kernel)."""
        dropout_p = self.attn_pdrop if self.training else 0.0
        return self.attn_fn(q, k, v, mask, dropout_p, self.softmax_scale)

    def forward(
        self,
        x: torch.Tensor,
        mask: AttentionMask,
        cache: LayerKV | None = None,
        rope: Rope | None = None,
    ) -> torch.Tensor:
        q, k, v = self.project(x, rope)
        if cache is not None:  # attend over the cached positions and the new ones
            k, v = cache.append(k, v)
        return self.attend(q, k, v, mask)


class InfiniAttention(Attention):
    """Attention with infini-attention's compressive memory across segments (`cfg.infini`).

    The projections are Attention's; `gate` holds each head's mixing logit beta, in its own
    optimizer group (its own lr, no weight decay: `own_param_groups`, read by
    `llmfoundry.optim.build_param_groups`). The recurrence is in `infini.py`.
    """

    def __init__(self, cfg: MPTConfig) -> None:
        super().__init__(cfg)
        self.infini = cfg.infini
        self.gate = nn.Parameter(torch.empty(cfg.n_heads))
        overrides = {"weight_decay": 0.0}
        if cfg.infini.gate_lr is not None:
            overrides["lr"] = cfg.infini.gate_lr
        self.own_param_groups = {"gate": ("infini_gate", overrides)}

    def kernel(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask
    ) -> torch.Tensor:
        cfg = self.infini
        return infini_attention(
            q,
            k,
            v,
            mask,
            self.gate,
            cfg.segment_len,
            cfg.update,
            cfg.eps,
            cfg.truncate_every,
            local=super().kernel,
        )

    def forward(
        self,
        x: torch.Tensor,
        mask: AttentionMask,
        cache: InfiniState | None = None,
        rope: None = None,  # MPTConfig refuses rope with infini
    ) -> torch.Tensor:
        if cache is None:
            return super().forward(x, mask)
        q, k, v = self.project(x)
        cfg = self.infini
        y = infini_attention_step(
            q,
            k,
            v,
            mask,
            self.gate,
            cfg.segment_len,
            cfg.update,
            cfg.eps,
            local=super().kernel,
            state=cache,
        )
        batch, _, q_len, _ = q.shape
        return self.out_proj(y.transpose(1, 2).reshape(batch, q_len, -1))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm_1(x)), then x + ffn(norm_2(x)).

    The ffn is `expansion_ratio * d_model` wide: an MLP, or a GLU (`ffn_type=glu`)."""

    def __init__(self, cfg: MPTConfig) -> None:
        super().__init__()
        norm = (cfg.norm_type, cfg.d_model, not cfg.no_bias, cfg.low_precision_layernorm)
        self.norm_1 = build_norm(*norm)
        self.attn = Attention(cfg) if cfg.infini is None else InfiniAttention(cfg)
        self.norm_2 = build_norm(*norm)
        ffn = GLU if cfg.ffn_type == "glu" else MLP
        hidden = cfg.expansion_ratio * cfg.d_model
        self.ffn = ffn(cfg.d_model, hidden, not cfg.no_bias, cfg.ffn_act)
        self.resid_attn_dropout = nn.Dropout(cfg.resid_pdrop)
        self.resid_ffn_dropout = nn.Dropout(cfg.resid_pdrop)

    def forward(
        self,
        x: torch.Tensor,
        mask: AttentionMask,
        cache: LayerKV | InfiniState | None = None,
        rope: Rope | None = None,
    ) -> torch.Tensor:
        x = x + self.resid_attn_dropout(self.attn(self.norm_1(x), mask, cache, rope))
        return x + self.resid_ffn_dropout(self.ffn(self.norm_2(x)))


class MPTModel(nn.Module):
    """Token (and optional position) embeddings, the blocks, and the final norm.

    A learned table and RoPE number each packed document's tokens from 0 (`sequence_id`). For
    RoPE that is what llm-foundry computes, which counts on across the packed row: a rotation's
    score depends only on the distance between query and key, and documents never attend to
    each other."""

    def __init__(self, cfg: MPTConfig) -> None:
        super().__init__()
        self.learned_pos_emb = cfg.learned_pos_emb
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        if cfg.learned_pos_emb:
            self.wpe = nn.Embedding(cfg.max_seq_len, cfg.d_model)
        self.rope = None
        if cfg.rope:
            scaling = cfg.rope_linear_scaling
            scaling = None if scaling is None else LinearRopeScaling(scaling)
            self.rope = RotaryEmbedding(cfg.d_model // cfg.n_heads, cfg.rope_theta, scaling)
        self.emb_drop = nn.Dropout(cfg.emb_pdrop)
        alibi = ALiBi(cfg.alibi_bias_max) if cfg.alibi else None
        # Infini-attention's kernel runs on segments, not the forward's lengths: no preparing.
        prepare = PREPARE[cfg.attn_impl] if cfg.infini is None else None
        self.masks = AttentionMasks(
            cfg.n_heads, cfg.max_seq_len, alibi, cfg.sliding_window, prepare
        )
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm_f = build_norm(
            cfg.norm_type, cfg.d_model, not cfg.no_bias, cfg.low_precision_layernorm
        )

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The token embedding, plus the learned positions' if the model has them."""
        x = self.wte(input_ids)
        if self.learned_pos_emb:
            x = x + self.wpe(positions)
        return self.emb_drop(x)

    def forward(
        self,
        input_ids: torch.Tensor,
        sequence_id: torch.Tensor | None = None,
        cache: Keys | None = None,
    ) -> torch.Tensor:
        seq_len, device = input_ids.shape[1], input_ids.device
        # With a cache, sequence_id covers its keys too, and queries may sit among them.
        sequence_id, queries, k_len = attend_over(cache, sequence_id, seq_len, device)
        positions = token_positions(sequence_id, seq_len, k_len, queries, device)
        x = self.embed(input_ids, positions)
        rope = None if self.rope is None else self.rope(positions)
        mask = self.masks(sequence_id, x.device, compute_dtype(x), (seq_len, k_len), queries)
        layers = [None] * len(self.blocks) if cache is None else cache.layers
        for block, layer_cache in zip(self.blocks, layers, strict=True):
            x = block(x, mask, layer_cache, rope)
        return self.norm_f(x)


class MPTForCausalLM(nn.Module):
    """MPT with its output head: the token embedding (logits = h @ wte.weight^T), or its own
    `lm_head` with `tie_word_embeddings=false`."""

    def __init__(self, config: MPTConfig) -> None:
        super().__init__()
        self.config = config
        # Always build on meta, then materialise: no memory is spent on PyTorch's default init,
        # and the meta path every large model takes is the one every small model takes too.
        with torch.device("meta"):
            self.transformer = MPTModel(config)
            if not config.tie_word_embeddings:
                self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.init_device != "meta":
            self.to_empty(device=config.init_device)
            self.init_weights()

    def forward(
        self,
        input_ids: torch.Tensor | Mapping[str, torch.Tensor],
        sequence_id: torch.Tensor | None = None,
        cache: Keys | None = None,
    ) -> torch.Tensor:
        """Logits [batch, seq, vocab] for `input_ids` [batch, seq].

        `sequence_id` [batch, seq] marks the documents packed into each row; tokens then attend
        only to earlier tokens of their own document. With a `cache` (see `kv_cache.py`),
        `input_ids` are the tokens after the cached ones: they attend to those too, and the cache
        is extended with them (decoding; `llmfoundry.models.generation`). Any `Keys` may stand
        for the cache: a context-parallel rank's gives the other ranks' keys, and `input_ids`
        are then its part of the sequence (llmfoundry/distributed/context.py).

        `input_ids` may instead be a whole batch, the trainer's ``model(batch)``
        (`llmfoundry.core.model`): its ``input_ids`` and ``sequence_id`` (if any) are used.
        """
        if isinstance(input_ids, Mapping):
            if sequence_id is not None or cache is not None:
                raise ValueError("pass sequence_id inside the batch; a batch takes no cache")
            input_ids, sequence_id = input_ids["input_ids"], input_ids.get("sequence_id")
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
        if sequence_id is not None and sequence_id.shape != input_ids.shape:
            raise ValueError(
                f"sequence_id shape {tuple(sequence_id.shape)} must equal input_ids shape "
                f"{tuple(input_ids.shape)}"
            )
        total_len = input_ids.shape[1] + (0 if cache is None else cache.length)
        if self.config.learned_pos_emb and total_len > self.config.max_seq_len:
            raise UserError(
                f"sequence length {total_len} exceeds max_seq_len "
                f"{self.config.max_seq_len}, the size of the learned position table; use rows "
                "of at most max_seq_len tokens or a model with a larger max_seq_len"
            )
        h = self.transformer(input_ids, sequence_id, cache)
        if self.config.tie_word_embeddings:
            return F.linear(h, self.transformer.wte.weight)
        return self.lm_head(h)  # a module call, so a plan applied from outside sees its input

    def output_embedding(self) -> torch.Tensor:
        """The output head's weight [vocab, d_model]: lm_head's, or the tied token embedding."""
        if self.config.tie_word_embeddings:
            return self.transformer.wte.weight
        return self.lm_head.weight

    loss = staticmethod(next_token_loss)

    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Number of parameters (a tied output head counted once).

        `exclude_embeddings` leaves out the token and position tables (an untied output head
        stays: it is a matmul, as Llama's count has it).
        """
        n = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            n -= self.transformer.wte.weight.numel()
            if self.config.learned_pos_emb:
                n -= self.transformer.wpe.weight.numel()
        return n

    def flops_per_token(self, seq_len: int) -> int:
        """Training flops per token (forward + backward): 6 * N + 12 * n_layers * d_model * seq_len.

        N counts the weights of every matrix multiply a token goes through: the projections of
        each block (Wqkv, out_proj, up_proj, down_proj, and a GLU's gate_proj) and the output
        head (vocab x d_model, tied or not). Embedding lookups, norms and biases are left out: they cost no matmul flops.
        The second term is attention's q k^T and weights @ v, counted over the full (not causal)
        square as is the convention for MFU (over one segment with infini-attention, whose
        memory costs O(head_dim^2) per token, not O(seq_len)).
        """
        cfg = self.config
        d = cfg.d_model
        kv_dim = cfg.kv_n_heads * (d // cfg.n_heads)
        ffn_matrices = 3 if cfg.ffn_type == "glu" else 2
        per_block = d * (d + 2 * kv_dim) + d * d + ffn_matrices * cfg.expansion_ratio * d * d
        n_matmul = cfg.n_layers * per_block + cfg.vocab_size * d
        if cfg.infini is not None:  # local attention spans one segment
            seq_len = min(seq_len, cfg.infini.segment_len)
        return 6 * n_matmul + 12 * cfg.n_layers * d * seq_len

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re)initialise every parameter in place; also after `to_empty(device=...)`."""
        cfg = self.config
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                if cfg.init_std is None:
                    nn.init.kaiming_normal_(module.weight, mode="fan_in", nonlinearity="relu")
                else:
                    nn.init.normal_(module.weight, mean=0.0, std=cfg.init_std)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.LayerNorm | nn.RMSNorm):
                module.reset_parameters()
        residual_scale = 1.0 / math.sqrt(2 * cfg.n_layers)
        for block in self.transformer.blocks:
            if isinstance(block.attn, InfiniAttention):
                block.attn.gate.fill_(cfg.infini.gate_init)
            block.attn.out_proj.weight.mul_(residual_scale)
            block.ffn.down_proj.weight.mul_(residual_scale)
        self.transformer.masks.reset()
        if self.transformer.rope is not None:
            self.transformer.rope.reset()

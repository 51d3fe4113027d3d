"""The decoder every family is: one transformer, its choices spelled out in a `DecoderSpec`.

Read top to bottom: the spec, Attention, the feed-forward choice, Block, Decoder (embeddings,
blocks, final norm), DecoderLM (output head, loss, parameter and flop counts, init). A family
is its config (whose `decoder_spec()` gives the numbers and choices), a model class that
subclasses `DecoderLM` with what is only its own (MPT's infini-attention), its spec.py, HF
adapter and parallelize plan. What the blocks call is shared below this file too: the position
schemes (`position.py`: RoPE with its scalings, ALiBi), the attention mask and kernels
(`attention.py`, `kernels.py`), the MLPs (`ffn.py`), the norms (`models/norms.py`), the KV
cache (`kv_cache.py`) and the chunked loss (`core/loss.py`).

Module names are those of the checkpoints the families wrote before they shared this file
(MPT's fused `attn.Wqkv` and `attn.q_ln`/`k_ln`, Llama's `attn.q_proj`/`k_proj`/`v_proj`, both
`transformer.wte`, `transformer.blocks.N.{norm_1, attn, norm_2, ffn}`, `transformer.norm_f`,
`lm_head`), so old checkpoints load and exports rename as before. Modules are built in the
order the families built theirs, so a seeded init draws the same weights.

Rotary embeddings follow transformers' (the rotate_half pairing: dimension i rotates with
i + head_dim / 2), so HF q/k projections load without a permutation. The model knows nothing
of parallelism or of the trainer.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmfoundry.core.loss import Labels, next_token_loss
from llmfoundry.core.metrics import DeviceScalar
from llmfoundry.models.layers.attention import AttentionMask, AttentionMasks, compute_dtype
from llmfoundry.models.layers.ffn import GLU, MLP
from llmfoundry.models.layers.kernels import ATTN_IMPLS, PREPARE
from llmfoundry.models.layers.kv_cache import Keys, LayerKV, attend_over
from llmfoundry.models.layers.moe import GroupedExperts, MoE, MoESpec, RouterLossMeter
from llmfoundry.models.layers.position import ALiBi, RotaryEmbedding, apply_rope, token_positions
from llmfoundry.models.norms import LayerNorm, RMSNorm, build_norm
from llmfoundry.utils.errors import UserError

# RoPE's (cos, sin) of each position, [batch or 1, seq, head_dim] (`RotaryEmbedding`).
Rope = tuple[torch.Tensor, torch.Tensor]

# The dense causal/document bias that `sdpa` and `torch` read is cached for this many positions
# at least (longer inputs rebuild it at their length), unless a spec says otherwise
# (`mask_cache_len`). A max_seq_len of 131072 (Llama 3.1) would make that cache tens of
# gigabytes; this keeps it at 64 MB in float32 while a decoding step of a padded batch still
# reuses it.
MASK_CACHE_LEN = 4096

POSITIONS = ("rope", "alibi", "learned", "none")
QK_NORMS = (None, "head", "full")
FFNS = ("mlp", "glu", "moe")


@dataclass(frozen=True)
class DecoderSpec:
    """The numbers and choices of one decoder; a family config's `decoder_spec()` returns it.

    Its config has already refused what a user can get wrong; the spec is what the modules read.
    `head_dim` may differ from d_model / n_heads (Qwen3). `qkv_fused`: MPT's one `Wqkv`
    projection ([q | k | v]), else `q_proj`, `k_proj`, `v_proj`. `qk_norm`: "head" normalises
    each head's queries and keys with an RMSNorm (Qwen3's `q_norm`, `k_norm`), "full" the full
    query and key widths with a LayerNorm (MPT's `qk_ln`: `q_ln`, `k_ln`). `positions`: RoPE
    (at `rope_theta`, `rope_scaling` a position.RopeScaling or LinearRopeScaling), ALiBi, a
    learned table (`transformer.wpe`) or none. `norm`: "rmsnorm" or "layernorm"
    (models/norms.py). `ffn`: "mlp", "glu" (`ffn_hidden` wide, `ffn_act`) or "moe" (`moe`, a
    models/layers/moe.py MoESpec). `init_std`: N(0, init_std) for every matrix, or None for
    MPT's kaiming fan_in. `mask_cache_len`: positions the causal bias cache is built for
    (None: max_seq_len, at most MASK_CACHE_LEN).
    """

    d_model: int
    n_layers: int
    vocab_size: int
    max_seq_len: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    qkv_fused: bool = False
    qkv_bias: bool = False
    out_bias: bool = False
    qk_norm: str | None = None
    clip_qkv: float | None = None
    softmax_scale: float | None = None
    positions: str = "rope"
    rope_theta: float = 10000.0
    rope_scaling: Any = None
    alibi_bias_max: float = 8
    sliding_window: int | None = None
    norm: str = "rmsnorm"
    norm_eps: float = 1e-5
    norm_bias: bool = False
    low_precision_norm: bool = False
    ffn: str = "glu"
    ffn_hidden: int = 0
    ffn_act: str = "silu"
    ffn_bias: bool = False
    moe: MoESpec | None = None
    tie_word_embeddings: bool = False
    emb_pdrop: float = 0.0
    resid_pdrop: float = 0.0
    attn_pdrop: float = 0.0
    attn_impl: str = "sdpa"
    init_std: float | None = 0.02
    mask_cache_len: int | None = None

    def __post_init__(self) -> None:
        for name, value, allowed in (
            ("positions", self.positions, POSITIONS),
            ("qk_norm", self.qk_norm, QK_NORMS),
            ("ffn", self.ffn, FFNS),
        ):
            if value not in allowed:
                raise UserError(f"DecoderSpec.{name} must be one of {allowed}, got {value!r}")
        if (self.ffn == "moe") != (self.moe is not None):
            raise UserError(
                f"DecoderSpec.moe (an MoESpec) goes with ffn='moe' and only with it; got "
                f"ffn={self.ffn!r} and moe={self.moe!r}"
            )

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim


class Attention(nn.Module):
    """Causal self-attention with grouped key/value heads.

    `project` gives q [B, n_heads, L, head_dim] and k, v [B, n_kv_heads, L, head_dim] of the new
    tokens: one fused projection split [q | k | v] or three, clamped to +-clip_qkv, q and k
    normalised (over the full width before the split into heads, or per head after it), then
    rotated by RoPE. `forward` is `project`, the cache (k and v appended to the earlier ones),
    then `attend`: `kernel` (the `attn_impl` kernel; a subclass may replace it, as MPT's
    infini-attention does) and out_proj. Head counts are read from the projections' widths,
    not the spec, so the same code runs the slice of the heads a tensor-parallel rank holds.
    """

    def __init__(self, spec: DecoderSpec) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = spec.n_heads, spec.n_kv_heads, spec.head_dim
        self.softmax_scale = spec.softmax_scale or 1.0 / math.sqrt(self.head_dim)
        self.clip_qkv = spec.clip_qkv
        self.qk_norm = spec.qk_norm
        self.attn_pdrop = spec.attn_pdrop
        self.attn_fn = ATTN_IMPLS[spec.attn_impl]
        d, q_dim, kv_dim = spec.d_model, spec.q_dim, spec.kv_dim
        if spec.qkv_fused:
            self.Wqkv = nn.Linear(d, q_dim + 2 * kv_dim, bias=spec.qkv_bias)
        else:
            self.q_proj = nn.Linear(d, q_dim, bias=spec.qkv_bias)
            self.k_proj = nn.Linear(d, kv_dim, bias=spec.qkv_bias)
            self.v_proj = nn.Linear(d, kv_dim, bias=spec.qkv_bias)
        if spec.qk_norm == "full":  # a LayerNorm whatever `norm` is: llm-foundry's MPT does
            self.q_ln = LayerNorm(q_dim, spec.norm_bias, spec.low_precision_norm)
            self.k_ln = LayerNorm(kv_dim, spec.norm_bias, spec.low_precision_norm)
        self.out_proj = nn.Linear(q_dim, d, bias=spec.out_bias)
        if spec.qk_norm == "head":
            self.q_norm = RMSNorm(self.head_dim, spec.low_precision_norm, spec.norm_eps)
            self.k_norm = RMSNorm(self.head_dim, spec.low_precision_norm, spec.norm_eps)

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The projections of `x` [B, L, d]: q [B, L, q width], k and v [B, L, kv width]."""
        if hasattr(self, "Wqkv"):
            qkv = self.Wqkv(x)
            if self.clip_qkv is not None:
                qkv = qkv.clamp(min=-self.clip_qkv, max=self.clip_qkv)
            kv_dim = qkv.shape[-1] * self.n_kv_heads // (self.n_heads + 2 * self.n_kv_heads)
            return qkv.split([qkv.shape[-1] - 2 * kv_dim, kv_dim, kv_dim], dim=-1)
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(min=-self.clip_qkv, max=self.clip_qkv) for t in (q, k, v))
        return q, k, v

    def project(
        self, x: torch.Tensor, rope: Rope | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [B, n_heads, L, head_dim] and k, v [B, n_kv_heads, L, head_dim] for `x` [B, L, d];
        q and k normalised as `qk_norm` says and rotated by `rope` if given."""
        batch, seq_len, _ = x.shape
        q, k, v = self.qkv(x)
        if self.qk_norm == "full":
            q, k = self.q_ln(q), self.k_ln(k)
        q = q.view(batch, seq_len, -1, self.head_dim)
        k = k.view(batch, seq_len, -1, self.head_dim)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = v.view(batch, seq_len, -1, self.head_dim).transpose(1, 2)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        return q, k, v

    def kernel(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask
    ) -> torch.Tensor:
        """Each head's attention output [B, n_heads, q_len, head_dim] (`attn_impl`'s kernel)."""
        dropout_p = self.attn_pdrop if self.training else 0.0
        return self.attn_fn(q, k, v, mask, dropout_p, self.softmax_scale)

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask
    ) -> torch.Tensor:
        """`kernel` on q, k, v (queries are the last of the key positions), then out_proj."""
        y = self.kernel(q, k, v, mask)
        batch, _, q_len, _ = q.shape
        return self.out_proj(y.transpose(1, 2).reshape(batch, q_len, -1))

    def forward(
        self,
        x: torch.Tensor,
        mask: AttentionMask,
        rope: Rope | None = None,
        cache: LayerKV | None = None,
    ) -> torch.Tensor:
        q, k, v = self.project(x, rope)
        if cache is not None:  # attend over the cached positions and the new ones
            k, v = cache.append(k, v)
        return self.attend(q, k, v, mask)


def build_ffn(spec: DecoderSpec) -> nn.Module:
    """The block's feed-forward: an MLP, a gated MLP (GLU: SwiGLU with silu) or a mixture of
    experts (models/layers/moe.py)."""
    if spec.ffn == "moe":
        return MoE(spec.d_model, spec.moe)
    ffn = GLU if spec.ffn == "glu" else MLP
    return ffn(spec.d_model, spec.ffn_hidden, spec.ffn_bias, spec.ffn_act)


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm_1(x)), then x + ffn(norm_2(x)), each branch
    through its residual dropout."""

    def __init__(self, spec: DecoderSpec, attn: nn.Module) -> None:
        super().__init__()
        norm = (spec.norm, spec.d_model, spec.norm_bias, spec.low_precision_norm, spec.norm_eps)
        self.norm_1 = build_norm(*norm)
        self.attn = attn
        self.norm_2 = build_norm(*norm)
        self.ffn = build_ffn(spec)
        self.resid_attn_dropout = nn.Dropout(spec.resid_pdrop)
        self.resid_ffn_dropout = nn.Dropout(spec.resid_pdrop)

    def forward(
        self,
        x: torch.Tensor,
        mask: AttentionMask,
        rope: Rope | None = None,
        cache: Any = None,
    ) -> torch.Tensor:
        x = x + self.resid_attn_dropout(self.attn(self.norm_1(x), mask, rope, cache))
        return x + self.resid_ffn_dropout(self.ffn(self.norm_2(x)))


class Decoder(nn.Module):
    """Token (and learned position) embeddings, the blocks, and the final norm.

    Positions restart at 0 at each document of a packed row (`sequence_id`), for a learned table
    and RoPE alike, so a document sees the same positions packed as alone; left padding (its
    own document) likewise leaves the text's positions counting from its first token. `attention`
    makes each block's attention (the family's: `DecoderLM.make_attention`).
    """

    def __init__(self, spec: DecoderSpec, attention: Any) -> None:
        super().__init__()
        self.wte = nn.Embedding(spec.vocab_size, spec.d_model)
        if spec.positions == "learned":
            self.wpe = nn.Embedding(spec.max_seq_len, spec.d_model)
        self.rope = None
        if spec.positions == "rope":
            self.rope = RotaryEmbedding(spec.head_dim, spec.rope_theta, spec.rope_scaling)
        self.emb_drop = nn.Dropout(spec.emb_pdrop)
        alibi = ALiBi(spec.alibi_bias_max) if spec.positions == "alibi" else None
        mask_len = spec.mask_cache_len or min(spec.max_seq_len, MASK_CACHE_LEN)
        self.masks = AttentionMasks(
            spec.n_heads, mask_len, alibi, spec.sliding_window, PREPARE[spec.attn_impl]
        )
        self.blocks = nn.ModuleList(Block(spec, attention()) for _ in range(spec.n_layers))
        norm = (spec.norm, spec.d_model, spec.norm_bias, spec.low_precision_norm, spec.norm_eps)
        self.norm_f = build_norm(*norm)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The token embedding, plus the learned positions' if the model has them."""
        x = self.wte(input_ids)
        if hasattr(self, "wpe"):
            x = x + self.wpe(positions)
        return self.emb_drop(x)

    def forward(
        self,
        input_ids: torch.Tensor,
        sequence_id: torch.Tensor | None = None,
        cache: Keys | None = None,
    ) -> torch.Tensor:
        seq_len = input_ids.shape[1]
        return self.stage(input_ids, sequence_id, cache, seq_len=seq_len, first=True, last=True)

    def stage(
        self,
        inputs: torch.Tensor,
        sequence_id: torch.Tensor | None,
        keys: Keys | None,
        *,
        seq_len: int,
        first: bool,
        last: bool,
    ) -> torch.Tensor:
        """The forward of the blocks this module holds, over `seq_len` positions: from token
        ids (`first`) or the previous pipeline stage's hidden states (split by position under
        tensor parallelism), to the final norm's output (`last`) or this stage's hidden
        states. With `keys` (a KV cache, or a context-parallel rank's keys), sequence_id covers
        its keys too, and the queries may sit among them."""
        device = inputs.device
        sequence_id, queries, k_len = attend_over(keys, sequence_id, seq_len, device)
        positions = token_positions(sequence_id, seq_len, k_len, queries, device)
        x = self.embed(inputs, positions) if first else inputs
        rope = None if self.rope is None else self.rope(positions)
        mask = self.masks(sequence_id, x.device, compute_dtype(x), (seq_len, k_len), queries)
        layers = [None] * len(self.blocks) if keys is None else keys.layers
        for block, layer_keys in zip(self.blocks, layers, strict=True):
            x = block(x, mask, rope, layer_keys)
        return self.norm_f(x) if last else x


class DecoderLM(nn.Module):
    """The decoder with its output head: `lm_head`, or the token embedding if
    `tie_word_embeddings` (logits = h @ wte.weight^T).

    `config` is the family's config (what checkpoints record); `spec` its `decoder_spec()`.
    A family's model class subclasses this with a docstring and what is its own.
    """

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.spec: DecoderSpec = config.decoder_spec()
        # A mixture of experts' router losses, added to its loss and logged (`moe_loss`).
        self.moe_meter = None if self.spec.moe is None else RouterLossMeter(self.spec.moe)
        if self.moe_meter is not None:
            self.loss = self.moe_loss
        # Always build on meta, then materialise: no memory is spent on PyTorch's default init,
        # and the meta path every large model takes is the one every small model takes too.
        with torch.device("meta"):
            self.transformer = Decoder(self.spec, self.make_attention)
            if not self.spec.tie_word_embeddings:
                self.lm_head = nn.Linear(self.spec.d_model, self.spec.vocab_size, bias=False)
        if config.init_device != "meta":
            self.to_empty(device=config.init_device)
            self.init_weights()

    def make_attention(self) -> nn.Module:
        """One block's attention (a family may install its own subclass of `Attention`)."""
        return Attention(self.spec)

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
        if self.spec.positions == "learned" and total_len > self.spec.max_seq_len:
            raise UserError(
                f"sequence length {total_len} exceeds max_seq_len "
                f"{self.spec.max_seq_len}, the size of the learned position table; use rows "
                "of at most max_seq_len tokens or a model with a larger max_seq_len"
            )
        return self.head(self.transformer(input_ids, sequence_id, cache))

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Logits of the final norm's output `h`."""
        if self.spec.tie_word_embeddings:
            return F.linear(h, self.transformer.wte.weight)
        return self.lm_head(h)  # a module call, so a plan applied from outside sees its input

    def output_embedding(self) -> torch.Tensor:
        """The output head's weight [vocab, d_model]: lm_head's, or the tied token embedding."""
        if self.spec.tie_word_embeddings:
            return self.transformer.wte.weight
        return self.lm_head.weight

    # The loss is family-neutral: mean next-token cross-entropy, chunked (core/loss.py). A
    # mixture of experts' instances take `moe_loss` instead (set in __init__), so the class's
    # stays the plain function tests and callers use as `Family.loss(logits, labels)`.
    loss = staticmethod(next_token_loss)

    def moe_loss(self, logits: torch.Tensor, labels: Labels) -> torch.Tensor:
        """`next_token_loss` plus, after a training forward, the weighted router losses
        (`RouterLossMeter`; under gradient accumulation each microbatch's are weighted as its
        next-token loss is)."""
        loss = next_token_loss(logits, labels)
        router = None if self.moe_meter is None else self.moe_meter.loss(self)
        return loss if router is None else loss + router

    def train_metrics(self) -> dict[str, DeviceScalar]:
        """A mixture of experts' router losses and expert load since the last call, logged by
        the trainer after each batch (`llmfoundry.core.model`); none for a dense model."""
        return {} if self.moe_meter is None else self.moe_meter.metrics()

    def num_params(self, exclude_embeddings: bool = False, active: bool = False) -> int:
        """Number of parameters (a tied head counted once).

        `exclude_embeddings` leaves out the token and position tables (an untied output head
        stays: it is a matmul, as torchtitan and the Llama papers count it). `active`: only
        those one token goes through (a mixture of experts' router, its top_k experts and
        shared expert, not all of its experts).
        """
        n = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            n -= self.transformer.wte.weight.numel()
            if hasattr(self.transformer, "wpe"):
                n -= self.transformer.wpe.weight.numel()
        if active and self.spec.ffn == "moe":
            moe = self.spec.moe
            for block in self.transformer.blocks:
                experts = sum(p.numel() for p in block.ffn.experts.parameters())
                n -= experts * (moe.n_experts - moe.top_k) // moe.n_experts
        return n

    def matmul_params_per_token(self) -> int:
        """The weights of every matrix multiply one token goes through: per block the q, k, v
        and out projections and the feed-forward's matrices (a mixture of experts': its router,
        top_k experts and shared expert), and the output head (vocab x d_model, tied or not).
        Embedding lookups, norms and biases cost no matmul flops."""
        s = self.spec
        d = s.d_model
        attn = d * (s.q_dim + 2 * s.kv_dim) + s.q_dim * d
        if s.ffn == "moe":
            moe = s.moe
            ffn = d * moe.n_experts + moe.top_k * 3 * d * moe.expert_hidden
            ffn += 3 * d * moe.shared_expert_hidden + (d if moe.shared_expert_gate else 0)
        else:
            ffn = (3 if s.ffn == "glu" else 2) * d * s.ffn_hidden
        return s.n_layers * (attn + ffn) + s.vocab_size * d

    def flops_per_token(self, seq_len: int) -> int:
        """Training flops per token (forward + backward): 6 * N + 12 * n_layers * q width *
        seq_len, N the active matmul weights (`matmul_params_per_token`). The second term is
        attention's q k^T and weights @ v over the full (not causal) square, the MFU convention.
        """
        s = self.spec
        return 6 * self.matmul_params_per_token() + 12 * s.n_layers * s.q_dim * seq_len

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re)initialise every parameter in place; also after `to_empty(device=...)`.

        Every matrix and embedding from N(0, init_std) (or kaiming fan_in without one), biases
        0, norms 1; the projections that write into the residual stream (attention out_proj,
        the feed-forward's down_proj) divided by sqrt(2 * n_layers), so the residual variance
        does not grow with depth."""
        std = self.spec.init_std
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                if std is None:
                    nn.init.kaiming_normal_(module.weight, mode="fan_in", nonlinearity="relu")
                else:
                    nn.init.normal_(module.weight, mean=0.0, std=std)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.LayerNorm | nn.RMSNorm):
                module.reset_parameters()
            elif isinstance(module, GroupedExperts):
                module.init_weights(std)
        residual_scale = 1.0 / math.sqrt(2 * self.spec.n_layers)
        for block in self.transformer.blocks:
            block.attn.out_proj.weight.mul_(residual_scale)
            if hasattr(block.ffn, "down_proj"):
                block.ffn.down_proj.weight.mul_(residual_scale)
            if isinstance(block.ffn, MoE):
                block.ffn.experts.w_down.mul_(residual_scale)
                if block.ffn.shared_expert is not None:
                    block.ffn.shared_expert.down_proj.weight.mul_(residual_scale)
        self.transformer.masks.reset()
        if self.transformer.rope is not None:
            self.transformer.rope.reset()

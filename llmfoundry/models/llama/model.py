"""Llama: a decoder-only transformer with RoPE, grouped-query attention, SwiGLU and RMSNorm.

Read top to bottom: RMSNorm, Attention, MLP, Block, LlamaModel (embedding, blocks, final norm),
LlamaForCausalLM (output head, tied or not; loss, flops, init). What is not Llama's own is
shared by every family (`llmfoundry.models.layers`): RoPE (`position.py`, with Llama 3.1's
frequency scaling), the attention kernels and their mask description (`attention.py`,
`kernels.py`: causal, document masking, GQA), the KV cache (`kv_cache.py`) and the chunked loss
(`loss.py`). Decoding (`llmfoundry.models.generation`: `generate(model, ...)`, `Decoder`) takes
this model as it takes any family's.

Rotary embeddings follow transformers' LlamaForCausalLM (the rotate_half pairing: dimension i
rotates with i + head_dim / 2), so its q_proj and k_proj weights load without a permutation.
Module names follow this repo's MPT (`transformer.blocks.0.attn.q_proj.weight`, ...), so the
plan and generation find the same parts in both families; `hf.py` renames to and from
transformers' names. The model knows nothing of parallelism or of the trainer.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from llmfoundry.core.loss import next_token_loss
from llmfoundry.models.layers.attention import AttentionMask, AttentionMasks, compute_dtype
from llmfoundry.models.layers.ffn import GLU
from llmfoundry.models.layers.kernels import ATTN_IMPLS, PREPARE
from llmfoundry.models.layers.kv_cache import Keys, LayerKV, attend_over
from llmfoundry.models.layers.position import RotaryEmbedding, apply_rope, token_positions
from llmfoundry.models.llama.config import LlamaConfig

# The dense causal/document bias that `sdpa` and `torch` read is cached for this many positions
# at least (longer inputs rebuild it at their length). A Llama config's max_seq_len (131072 for
# Llama 3.1) would make that cache tens of gigabytes; this keeps it at 64 MB in float32 while
# a decoding step of a padded batch still reuses it.
MASK_CACHE_LEN = 4096


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 and cast back before the weight (as Llama)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class Attention(nn.Module):
    """Causal self-attention with RoPE on queries and keys and grouped key/value heads.

    `project` gives the rotated q [B, n_heads, L, head_dim] and k, v [B, n_kv_heads, L, head_dim]
    of the new tokens; with a cache, k and v are appended to the earlier (already rotated) ones,
    and every query attends over all of them with the kernel of `attn_impl`.
    """

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.softmax_scale = 1.0 / math.sqrt(self.head_dim)
        self.attn_fn = ATTN_IMPLS[cfg.attn_impl]
        kv_dim = cfg.n_kv_heads * cfg.head_dim
        self.q_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.k_proj = nn.Linear(cfg.d_model, kv_dim, bias=False)
        self.v_proj = nn.Linear(cfg.d_model, kv_dim, bias=False)
        self.out_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def project(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        batch, seq_len, _ = x.shape
        # Head counts read from the projections' widths (-1), so the heads of a tensor-parallel
        # shard (a slice of the projections' outputs) are split the same way.
        q = self.q_proj(x).view(batch, seq_len, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq_len, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq_len, -1, self.head_dim).transpose(1, 2)
        return apply_rope(q, *rope), apply_rope(k, *rope), v

    def forward(
        self,
        x: torch.Tensor,
        mask: AttentionMask,
        rope: tuple[torch.Tensor, torch.Tensor],
        cache: LayerKV | None = None,
    ) -> torch.Tensor:
        q, k, v = self.project(x, rope)
        if cache is not None:  # attend over the cached positions and the new ones
            k, v = cache.append(k, v)
        y = self.attn_fn(q, k, v, mask, 0.0, self.softmax_scale)
        batch, _, q_len, _ = q.shape
        return self.out_proj(y.transpose(1, 2).reshape(batch, q_len, -1))


class MLP(GLU):
    """SwiGLU feed-forward: down_proj(silu(gate_proj(x)) * up_proj(x)), no biases."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__(cfg.d_model, cfg.ffn_hidden_size, bias=False, act="silu")


class Block(nn.Module):
    """Pre-RMSNorm transformer block: x + attn(norm_1(x)), then x + ffn(norm_2(x))."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.norm_1 = RMSNorm(cfg.d_model, cfg.rms_norm_eps)
        self.attn = Attention(cfg)
        self.norm_2 = RMSNorm(cfg.d_model, cfg.rms_norm_eps)
        self.ffn = MLP(cfg)

    def forward(
        self,
        x: torch.Tensor,
        mask: AttentionMask,
        rope: tuple[torch.Tensor, torch.Tensor],
        cache: LayerKV | None = None,
    ) -> torch.Tensor:
        x = x + self.attn(self.norm_1(x), mask, rope, cache)
        return x + self.ffn(self.norm_2(x))


class LlamaModel(nn.Module):
    """The token embedding, the blocks, and the final RMSNorm.

    Positions restart at 0 at each document of a packed row (`sequence_id`), as MPT's learned
    positions do, so a document sees the same rotations packed as alone; left padding (its own
    document) likewise leaves the text's positions counting from its first token.
    """

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        mask_len = min(cfg.max_seq_len, MASK_CACHE_LEN)
        self.masks = AttentionMasks(cfg.n_heads, mask_len, prepare=PREPARE[cfg.attn_impl])
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm_f = RMSNorm(cfg.d_model, cfg.rms_norm_eps)

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
        x = self.wte(input_ids)
        rope = self.rope(positions)
        mask = self.masks(sequence_id, x.device, compute_dtype(x), (seq_len, k_len), queries)
        layers = [None] * len(self.blocks) if cache is None else cache.layers
        for block, layer_cache in zip(self.blocks, layers, strict=True):
            x = block(x, mask, rope, layer_cache)
        return self.norm_f(x)


class LlamaForCausalLM(nn.Module):
    """Llama with its output head: `lm_head`, or the token embedding if `tie_word_embeddings`."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        # As MPT: always build on meta, then materialise, so no memory goes to a default init.
        with torch.device("meta"):
            self.transformer = LlamaModel(config)
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

        The arguments are `MPTForCausalLM.forward`'s: `sequence_id` [batch, seq] marks packed
        documents (each attends only within itself, and its positions start at 0); a `cache`
        (`llmfoundry.models.layers.kv_cache.KVCache`, or any `Keys`: a context-parallel rank's)
        holds the other tokens' keys and values;
        `input_ids` may be the trainer's whole batch (`llmfoundry.core.model`).
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
        h = self.transformer(input_ids, sequence_id, cache)
        if self.config.tie_word_embeddings:
            return F.linear(h, self.transformer.wte.weight)
        return self.lm_head(h)  # a module call, so a plan applied from outside sees its input

    def output_embedding(self) -> torch.Tensor:
        """The output head's weight [vocab, d_model]: lm_head's, or the tied token embedding."""
        if self.config.tie_word_embeddings:
            return self.transformer.wte.weight
        return self.lm_head.weight

    # The loss is family-neutral: mean next-token cross-entropy, chunked (core/loss.py).
    loss = staticmethod(next_token_loss)

    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Number of parameters (a tied head counted once).

        `exclude_embeddings` leaves out the token table (an untied output head stays: it is a
        matmul, as torchtitan and the Llama papers count it).
        """
        n = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            n -= self.transformer.wte.weight.numel()
        return n

    def flops_per_token(self, seq_len: int) -> int:
        """Training flops per token (forward + backward): 6 * N + 12 * n_layers * d_model * seq_len.

        N counts the weights of every matrix multiply a token goes through: per block q, k, v,
        out_proj and the MLP's three matrices, and the output head (vocab x d_model, tied or
        not). The second term is attention's q k^T and weights @ v over the full square, the MFU
        convention (as MPTForCausalLM.flops_per_token).
        """
        cfg = self.config
        d = cfg.d_model
        kv_dim = cfg.n_kv_heads * cfg.head_dim
        per_block = d * (d + 2 * kv_dim) + d * d + 3 * d * cfg.ffn_hidden_size
        n_matmul = cfg.n_layers * per_block + cfg.vocab_size * d
        return 6 * n_matmul + 12 * cfg.n_layers * d * seq_len

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re)initialise every parameter in place; also after `to_empty(device=...)`."""
        cfg = self.config
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=cfg.init_std)
            elif isinstance(module, RMSNorm):
                module.reset_parameters()
        residual_scale = 1.0 / math.sqrt(2 * cfg.n_layers)
        for block in self.transformer.blocks:
            block.attn.out_proj.weight.mul_(residual_scale)
            block.ffn.down_proj.weight.mul_(residual_scale)
        self.transformer.masks.reset()
        self.transformer.rope.reset()

"""MPT: a decoder-only transformer with ALiBi, tied embeddings and pre-LayerNorm blocks.

Read top to bottom: LayerNorm (with the low-precision option), Attention, MLP, Block, MPTModel
(embeddings, blocks, final norm), MPTForCausalLM (tied output head, loss, flops, init, sampling).
Parameter names follow transformers' MptForCausalLM (`transformer.blocks.0.attn.Wqkv.weight`, ...)
so exporting is a state dict copy. The model knows nothing of parallelism or of the trainer.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from llmfoundry.models.mpt.attention import ATTN_IMPLS, AttentionBias
from llmfoundry.models.mpt.config import MPTConfig
from llmfoundry.models.mpt.loss import next_token_loss_sum

LAYER_NORM_EPS = 1e-5


class LayerNorm(nn.LayerNorm):
    """LayerNorm that, with `low_precision=True`, runs in the autocast dtype.

    Autocast normally computes LayerNorm in float32; MPT's low-precision LayerNorm casts input,
    weight and bias to the autocast dtype (bf16) instead, trading a little precision for speed and
    memory. Outside autocast it is an ordinary LayerNorm.
    """

    def __init__(self, dim: int, bias: bool, low_precision: bool) -> None:
        super().__init__(dim, eps=LAYER_NORM_EPS, bias=bias)
        self.low_precision = low_precision

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        device = x.device.type
        if not (self.low_precision and torch.is_autocast_enabled(device)):
            return super().forward(x)
        dtype = torch.get_autocast_dtype(device)
        bias = None if self.bias is None else self.bias.to(dtype)
        with torch.autocast(device, enabled=False):
            return F.layer_norm(
                x.to(dtype), self.normalized_shape, self.weight.to(dtype), bias, self.eps
            )


class Attention(nn.Module):
    """Multi-head causal self-attention with a fused QKV projection.

    `clip_qkv` clamps the fused projection (a guard against loss spikes); `qk_ln` normalises
    queries and keys over the full model width before they are split into heads.
    """

    def __init__(self, cfg: MPTConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.clip_qkv = cfg.clip_qkv
        self.qk_ln = cfg.qk_ln
        self.attn_pdrop = cfg.attn_pdrop
        self.attn_fn = ATTN_IMPLS[cfg.attn_impl]
        self.Wqkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=not cfg.no_bias)
        if cfg.qk_ln:
            self.q_ln = LayerNorm(cfg.d_model, not cfg.no_bias, cfg.low_precision_layernorm)
            self.k_ln = LayerNorm(cfg.d_model, not cfg.no_bias, cfg.low_precision_layernorm)
        self.out_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=not cfg.no_bias)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        batch, seq_len, d_model = x.shape
        qkv = self.Wqkv(x)
        if self.clip_qkv is not None:
            qkv = qkv.clamp(min=-self.clip_qkv, max=self.clip_qkv)
        q, k, v = qkv.split(d_model, dim=-1)
        if self.qk_ln:
            q, k = self.q_ln(q), self.k_ln(k)
        q, k, v = (t.view(batch, seq_len, self.n_heads, -1).transpose(1, 2) for t in (q, k, v))
        dropout_p = self.attn_pdrop if self.training else 0.0
        y = self.attn_fn(q, k, v, bias, dropout_p)
        return self.out_proj(y.transpose(1, 2).reshape(batch, seq_len, d_model))


class MLP(nn.Module):
    """GELU feed-forward: d_model -> expansion_ratio * d_model -> d_model."""

    def __init__(self, cfg: MPTConfig) -> None:
        super().__init__()
        hidden = cfg.expansion_ratio * cfg.d_model
        self.up_proj = nn.Linear(cfg.d_model, hidden, bias=not cfg.no_bias)
        self.down_proj = nn.Linear(hidden, cfg.d_model, bias=not cfg.no_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.up_proj(x)))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(norm_1(x)), then x + ffn(norm_2(x))."""

    def __init__(self, cfg: MPTConfig) -> None:
        super().__init__()
        bias, low_precision = not cfg.no_bias, cfg.low_precision_layernorm
        self.norm_1 = LayerNorm(cfg.d_model, bias, low_precision)
        self.attn = Attention(cfg)
        self.norm_2 = LayerNorm(cfg.d_model, bias, low_precision)
        self.ffn = MLP(cfg)
        self.resid_attn_dropout = nn.Dropout(cfg.resid_pdrop)
        self.resid_ffn_dropout = nn.Dropout(cfg.resid_pdrop)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x = x + self.resid_attn_dropout(self.attn(self.norm_1(x), bias))
        return x + self.resid_ffn_dropout(self.ffn(self.norm_2(x)))


def positions_in_document(sequence_id: torch.Tensor) -> torch.Tensor:
    """Position of each token within its document: 0 at each document's first token.

    Packed rows hold several documents; restarting positions at each one gives a learned position
    table the same view of a document as if it were alone. Documents are contiguous runs of equal
    `sequence_id`.
    """
    seq_len = sequence_id.shape[1]
    pos = torch.arange(seq_len, device=sequence_id.device).expand_as(sequence_id)
    starts = torch.ones_like(sequence_id, dtype=torch.bool)
    starts[:, 1:] = sequence_id[:, 1:] != sequence_id[:, :-1]
    start_pos = torch.where(starts, pos, torch.zeros_like(pos)).cummax(dim=1).values
    return pos - start_pos


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the attention scores will have: autocast's if it is on, else the input's."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


class MPTModel(nn.Module):
    """Token (and optional position) embeddings, the blocks, and the final LayerNorm."""

    def __init__(self, cfg: MPTConfig) -> None:
        super().__init__()
        self.learned_pos_emb = cfg.learned_pos_emb
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        if cfg.learned_pos_emb:
            self.wpe = nn.Embedding(cfg.max_seq_len, cfg.d_model)
        self.emb_drop = nn.Dropout(cfg.emb_pdrop)
        self.attn_bias = AttentionBias(cfg.n_heads, cfg.max_seq_len, cfg.alibi, cfg.alibi_bias_max)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm_f = LayerNorm(cfg.d_model, not cfg.no_bias, cfg.low_precision_layernorm)

    def forward(
        self, input_ids: torch.Tensor, sequence_id: torch.Tensor | None = None
    ) -> torch.Tensor:
        seq_len = input_ids.shape[1]
        x = self.wte(input_ids)
        if self.learned_pos_emb:
            if sequence_id is None:
                pos = torch.arange(seq_len, device=input_ids.device)
            else:
                pos = positions_in_document(sequence_id)
            x = x + self.wpe(pos)
        x = self.emb_drop(x)
        bias = self.attn_bias(seq_len, sequence_id, x.device, compute_dtype(x))
        for block in self.blocks:
            x = block(x, bias)
        return self.norm_f(x)


class MPTForCausalLM(nn.Module):
    """MPT with its output head tied to the token embedding (logits = h @ wte.weight^T)."""

    def __init__(self, config: MPTConfig) -> None:
        super().__init__()
        self.config = config
        # Always build on meta, then materialise: no memory is spent on PyTorch's default init,
        # and the meta path every large model takes is the one every small model takes too.
        with torch.device("meta"):
            self.transformer = MPTModel(config)
        if config.init_device != "meta":
            self.to_empty(device=config.init_device)
            self.init_weights()

    def forward(
        self, input_ids: torch.Tensor, sequence_id: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits [batch, seq, vocab] for `input_ids` [batch, seq].

        `sequence_id` [batch, seq] marks the documents packed into each row; tokens then attend
        only to earlier tokens of their own document.
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
        if sequence_id is not None and sequence_id.shape != input_ids.shape:
            raise ValueError(
                f"sequence_id shape {tuple(sequence_id.shape)} must equal input_ids shape "
                f"{tuple(input_ids.shape)}"
            )
        if self.config.learned_pos_emb and input_ids.shape[1] > self.config.max_seq_len:
            raise ValueError(
                f"sequence length {input_ids.shape[1]} exceeds max_seq_len "
                f"{self.config.max_seq_len}, the size of the learned position table"
            )
        h = self.transformer(input_ids, sequence_id)
        return F.linear(h, self.transformer.wte.weight)

    @staticmethod
    def loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy over positions whose label is not -100.

        Position t's logits predict labels[t + 1], so labels are the inputs themselves. The loss is
        computed in float32. A batch with no counted position gives 0 (not NaN), so an all-padding
        microbatch adds nothing to an accumulated gradient.
        """
        if labels.shape != logits.shape[:-1]:
            raise ValueError(
                f"labels shape {tuple(labels.shape)} must equal logits shape without the vocab "
                f"dimension, {tuple(logits.shape[:-1])}"
            )
        total = next_token_loss_sum(logits, labels)  # chunked: no full float32 copy (loss.py)
        return total / (labels[:, 1:] != -100).sum().clamp(min=1)

    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Number of parameters (the tied output head counted once).

        `exclude_embeddings` leaves out the token and position tables.
        """
        n = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            n -= self.transformer.wte.weight.numel()
            if self.config.learned_pos_emb:
                n -= self.transformer.wpe.weight.numel()
        return n

    def flops_per_token(self, seq_len: int) -> int:
        """Training flops per token (forward + backward): 6 * N + 12 * n_layers * d_model * seq_len.

        N counts the weights of every matrix multiply a token goes through: the four projections
        of each block (Wqkv, out_proj, up_proj, down_proj) and the tied output head (vocab x
        d_model). Embedding lookups, norms and biases are left out: they cost no matmul flops.
        The second term is attention's q k^T and weights @ v, counted over the full (not causal)
        square as is the convention for MFU.
        """
        cfg = self.config
        d = cfg.d_model
        per_block = 3 * d * d + d * d + 2 * cfg.expansion_ratio * d * d
        n_matmul = cfg.n_layers * per_block + cfg.vocab_size * d
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
            elif isinstance(module, nn.LayerNorm):
                module.reset_parameters()
        residual_scale = 1.0 / math.sqrt(2 * cfg.n_layers)
        for block in self.transformer.blocks:
            block.attn.out_proj.weight.mul_(residual_scale)
            block.ffn.down_proj.weight.mul_(residual_scale)
        self.transformer.attn_bias.cached = None

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        eos_token_id: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Sample `max_new_tokens` tokens after `input_ids` [batch, seq]; returns prompt + samples.

        `temperature=0` is greedy decoding. Without a KV cache each step reruns the (cropped to
        max_seq_len) context, which is simple and fast enough for samples and tests. Rows that
        have produced `eos_token_id` keep emitting it; generation stops once every row has.
        """
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if top_k is not None and top_k <= 0:
            raise ValueError(f"top_k must be a positive integer or None, got {top_k}")
        was_training = self.training
        self.eval()
        try:
            return self._sample(
                input_ids, max_new_tokens, temperature, top_k, eos_token_id, generator
            )
        finally:
            self.train(was_training)

    def _sample(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        temperature: float,
        top_k: int | None,
        eos_token_id: int | None,
        generator: torch.Generator | None,
    ) -> torch.Tensor:
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        for _ in range(max_new_tokens):
            context = input_ids[:, -self.config.max_seq_len :]
            logits = self(context)[:, -1].float()
            if temperature == 0:
                next_token = logits.argmax(dim=-1)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                probs = torch.softmax(logits, dim=-1)
                next_token = torch.multinomial(probs, 1, generator=generator).squeeze(1)
            if eos_token_id is not None:
                next_token = next_token.masked_fill(done, eos_token_id)
                done |= next_token == eos_token_id
            input_ids = torch.cat([input_ids, next_token[:, None]], dim=1)
            if eos_token_id is not None and bool(done.all()):
                break
        return input_ids

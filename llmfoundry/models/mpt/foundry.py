"""llm-foundry's MPT config as ours (`mpt_config_from_foundry`) and ours as theirs
(`mpt_config_to_foundry`, its inverse, for exports in llm-foundry's layout).

llm-foundry describes an MPT model with one dict, the keyword arguments of its `MPTConfig`: the
`model:` block of a train YAML (``name: mpt_causal_lm``), the config.json of a folder its
`convert_composer_to_hf.py` writes or of a mosaicml/mpt-* download, and the config a Composer
checkpoint carries (``state['integrations']['huggingface']['model']['config']['content']``).
Our model computes what llm-foundry's does for every value mapped here (same parameter names,
same [q | k | v] layout, same ALiBi slopes); each other value is refused in one line naming the
key and what to use instead, so no model is built that silently computes something else.

Keys absent from the dict take llm-foundry's defaults, not ours (learned positions, biases,
its low-precision LayerNorm), since that is the model the dict describes. Accepted without a
field of ours, and why:
- `init_device`: where llm-foundry first allocates the weights; our build always starts on the
  meta device and the run's strategy places them, so the weights are the same either way.
- `attn_impl` (torch, flash, triton): the kernel, not the function; all become our `sdpa`,
  which runs torch's fused kernels (flash on a GPU). Set `attn_impl=flash` afterwards for the
  flash-attn package.
- `attn_uses_sequence_id`: our model masks documents whenever a batch carries `sequence_id`,
  which our data config decides (`data.sequence_id_from_eos`); a caller mapping a train YAML
  maps this key there. Without `sequence_id` (inference, an HF import) it changes nothing.
  With it and learned positions, ours number each document's tokens from 0, where llm-foundry's
  count on across the packed row.
- `use_pad_tok_in_ffn`: the MLP acts on each token alone, so skipping pad tokens changes no real
  token's output.
- `use_cache`, `verbose`, `tokenizer_name`, `loss_fn` (both of llm-foundry's compute the same
  cross-entropy), `name: mpt_causal_lm`, the `rope_*` options while `rope` is off, and
  transformers' own config keys (`TRANSFORMERS_KEYS`: names, versions, dtype, generate()
  defaults, token ids), none of which llm-foundry's MPT forward reads.
- `init_config`: mapped to our init (`init_std`) where we have it. An init we lack is refused
  for a model about to train from scratch, and accepted with `weights_loaded=True` (the weights
  come from a checkpoint, so no init runs).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from omegaconf import DictConfig, OmegaConf

from llmfoundry.models.mpt.config import MPTConfig
from llmfoundry.models.norms import LAYER_NORM_EPS
from llmfoundry.utils.errors import UserError

__all__ = [
    "MPT_TARGET",
    "TRANSFORMERS_KEYS",
    "mpt_config_from_foundry",
    "mpt_config_to_foundry",
]

MPT_TARGET = "llmfoundry.models.mpt.MPTConfig"

# llm-foundry 0.22's MPTConfig defaults (configuration_mpt.py, models/utils/config_defaults.py).
TOP_DEFAULTS: dict[str, Any] = {
    "d_model": 2048,
    "n_heads": 16,
    "n_layers": 24,
    "head_dim": None,
    "expansion_ratio": 4,
    "max_seq_len": 2048,
    "vocab_size": 50368,
    "resid_pdrop": 0.0,
    "emb_pdrop": 0.0,
    "learned_pos_emb": True,
    "no_bias": False,
    "attention_bias": None,
    "norm_type": "low_precision_layernorm",
    "norm_eps": 1e-05,
    "tie_word_embeddings": True,
}
ATTN_DEFAULTS: dict[str, Any] = {
    "attn_type": "multihead_attention",
    "attn_pdrop": 0.0,
    "qk_ln": False,
    "clip_qkv": None,
    "softmax_scale": None,
    "sliding_window_size": -1,
    "alibi": False,
    "alibi_bias_max": 8,
    "rope": False,
    "rope_theta": 10000,
    "rope_impl": "dail",
    "rope_dail_config": {"type": "original", "pos_idx_in_fp32": True, "xpos_scale_base": 512},
    "rope_hf_config": {"type": "no_scaling", "factor": 1.0},
    "kv_n_heads": None,
}
INIT_DEFAULTS: dict[str, Any] = {
    "name": "kaiming_normal_",
    "fan_mode": "fan_in",
    "init_nonlinearity": "relu",
    "init_div_is_residual": True,
    "emb_init_std": None,
    "emb_init_uniform_lim": None,
    "init_std": None,
    "init_gain": 0.0,
}

# transformers' PretrainedConfig keys (what its to_dict() and save_pretrained write for any
# model): bookkeeping and generate() defaults that llm-foundry's MPT forward never reads.
TRANSFORMERS_KEYS = frozenset(
    """_name_or_path _commit_hash _attn_implementation _attn_implementation_autoset
    _attn_implementation_internal add_cross_attention architectures auto_map bad_words_ids
    begin_suppress_tokens bos_token_id chunk_size_feed_forward cross_attention_hidden_size
    decoder_start_token_id diversity_penalty do_sample dtype early_stopping
    encoder_no_repeat_ngram_size eos_token_id exponential_decay_length_penalty finetuning_task
    forced_bos_token_id forced_eos_token_id id2label is_decoder is_encoder_decoder label2id
    length_penalty max_length min_length no_repeat_ngram_size num_beam_groups num_beams
    num_return_sequences output_attentions output_hidden_states output_scores pad_token_id
    prefix problem_type pruned_heads remove_invalid_values repetition_penalty return_dict
    return_dict_in_generate sep_token_id suppress_tokens task_specific_params temperature
    tf_legacy_loss tie_encoder_decoder tokenizer_class top_k top_p torch_dtype torchscript
    transformers_version typical_p use_bfloat16""".split()
)
# Keys that change nothing our model computes (the module docstring says why for each).
NO_EFFECT = frozenset(
    {"init_device", "use_cache", "use_pad_tok_in_ffn", "verbose", "tokenizer_name"}
)
ATTN_NO_EFFECT = frozenset({"attn_impl", "attn_uses_sequence_id"})
ROPE_KEYS = frozenset({"rope_theta", "rope_impl", "rope_dail_config", "rope_hf_config"})
LOSS_FNS = ("fused_crossentropy", "torch_crossentropy")
# llm-foundry's norm_type -> ours (norm_type, low_precision_layernorm). triton_rmsnorm is
# flash-attn's fused kernel of the same function, fed the float32 residual stream as torch's.
NORM_TYPES = {
    "layernorm": ("layernorm", False),
    "low_precision_layernorm": ("layernorm", True),
    "rmsnorm": ("rmsnorm", False),
    "low_precision_rmsnorm": ("rmsnorm", True),
    "triton_rmsnorm": ("rmsnorm", False),
}
KV_HEADS = {"multihead_attention": None, "multiquery_attention": 1}
MOE_FFNS = ("mb_moe", "mb_dmoe", "torch_dmoe")


def _plain(value: Any) -> Any:
    """`value` with any OmegaConf node turned into dicts and lists (a YAML's `model:` block)."""
    if isinstance(value, DictConfig):
        return OmegaConf.to_container(value, resolve=True)
    return value


def _section(cfg: Mapping[str, Any], key: str, defaults: Mapping[str, Any], where: str) -> dict:
    """The sub-dict `cfg[key]` (absent or null: empty) over llm-foundry's `defaults`."""
    value = cfg.get(key)
    if value is None:
        value = {}
    if not isinstance(value, Mapping):
        raise UserError(f"{where}.{key} must be a mapping, got {value!r}")
    return {**defaults, **value}


# (key, values we compute as llm-foundry does (the first: its default), what to do instead).
Fixed = tuple[str, tuple[Any, ...], str]
TOP_FIXED: tuple[Fixed, ...] = (
    ("model_type", ("mpt",), "this reads MPT configs only"),
    ("name", ("mpt_causal_lm",), "this reads MPT configs (hf_causal_lm names a transformers one)"),
    ("loss_fn", LOSS_FNS, "our loss is cross-entropy; use one of " + ", ".join(LOSS_FNS)),
    ("logit_scale", (None, 1, 1.0), "our output head does not scale its logits"),
    ("embedding_fraction", (1.0,), "our token embedding gets its full gradient; set 1.0"),
    ("norm_eps", (LAYER_NORM_EPS,), f"our LayerNorms use eps={LAYER_NORM_EPS}"),
    ("tie_word_embeddings", (True, False), "set true (the head is the embedding) or false"),
    ("block_overrides", (None,), "our blocks are all alike; remove the per-layer overrides"),
    ("final_logit_softcapping", (None,), "our output head does not soft-cap its logits"),
    ("fuse_norm_attn_norm", (False,), "our blocks keep norm_1, attn and norm_2 apart; set false"),
)
ATTN_FIXED: tuple[Fixed, ...] = (
    ("rope", (False, True), "set true or false"),
    ("nope", (False,), "use alibi or learned_pos_emb"),
    ("qk_gn", (False,), "our MPT has no per-head q/k norm; use qk_ln (over the full width)"),
    ("fused_qkv", (True,), "our attention has one fused Wqkv projection; set true"),
    ("attn_logit_softcapping", (None,), "our attention does not soft-cap its logits"),
    ("kv_dim", (None,), "our MPT has no cross-attention"),
    ("prefix_lm", (False,), "our MPT attends causally only; train with prefix_lm=false"),
    ("reuse_kv_layer_idx", (None,), "each of our blocks computes its own keys and values"),
    ("reuse_kv_x_layer_idx", (None,), "each of our blocks computes its own keys and values"),
    ("seq_parallel_world_size", (None, 1), "use parallelism.tp (it splits sequences too)"),
)
FFN_TYPES = {"mptmlp": "mlp", "mptglu": "glu"}
FFN_REFUSED = {
    "te_ln_mlp": "TransformerEngine's fused LayerNorm-MLP is not in our MPT; use ffn_type=mptmlp "
    "(fp8 training: converters=[float8])",
    **{moe: "DBRX's MoE is not supported; use ffn_type=mptmlp or mptglu" for moe in MOE_FFNS},
}
# llm-foundry's ffn_act_fn (torch.nn.functional's name and keyword arguments) -> our ffn_act.
ACTS = {
    (("approximate", "none"), ("name", "gelu")): "gelu",
    (("approximate", "tanh"), ("name", "gelu")): "gelu_tanh",
    (("name", "silu"),): "silu",
    (("name", "relu"),): "relu",
}


class _Keys:
    """One config dict's keys: each is read, checked or accepted, and any left over refused."""

    def __init__(self, cfg: Mapping[str, Any], where: str) -> None:
        self.cfg, self.where, self.seen = cfg, where, set()

    def get(self, key: str) -> Any:
        self.seen.add(key)
        return self.cfg.get(key)

    def accept(self, keys: frozenset[str]) -> None:
        self.seen.update(keys)

    def refuse(self, key: str, instead: str) -> UserError:
        return UserError(f"{self.where}.{key}={self.cfg.get(key)!r} is not supported: {instead}")

    def check(self, table: tuple[Fixed, ...]) -> None:
        """Each key of `table` absent or one of its values."""
        for key, allowed, instead in table:
            self.seen.add(key)
            if self.cfg.get(key, allowed[0]) not in allowed:
                raise self.refuse(key, instead)

    def refuse_unknown(self) -> None:
        if unknown := sorted(set(self.cfg) - self.seen):
            raise UserError(
                f"{self.where}.{unknown[0]}={self.cfg[unknown[0]]!r}: not a key of llm-foundry's "
                "MPT config (0.22) that llmfoundry knows; remove it or check its spelling"
            )


def _attention(attn: _Keys, n_heads: int) -> dict[str, Any]:
    """Our attention fields for llm-foundry's `attn_config`."""
    attn.accept(ATTN_NO_EFFECT)
    attn.check(ATTN_FIXED)
    tuning = attn.get("attn_temperature_tuning")
    if tuning is not None and (not isinstance(tuning, Mapping) or tuning.get("attn_scale")):
        raise attn.refuse("attn_temperature_tuning", "our attention has none; set attn_scale: 0")
    attn_type, kv_n_heads = attn.get("attn_type"), attn.get("kv_n_heads")
    if attn_type in KV_HEADS:
        fixed = KV_HEADS[attn_type] or n_heads
        if kv_n_heads not in (None, fixed):
            raise attn.refuse("kv_n_heads", f"{attn_type} has {fixed}; use grouped_query_attention")
        kv_n_heads = fixed
    elif attn_type != "grouped_query_attention":
        raise attn.refuse("attn_type", "use multihead_, multiquery_ or grouped_query_attention")
    window = attn.get("sliding_window_size")
    if window != -1 and (isinstance(window, bool) or not isinstance(window, int) or window < 0):
        raise attn.refuse("sliding_window_size", "use -1 (none) or a number of earlier tokens")
    fields = {
        **_rope(attn),
        "attn_impl": "sdpa",
        "kv_n_heads": kv_n_heads,
        "attn_pdrop": attn.get("attn_pdrop"),
        "qk_ln": bool(attn.get("qk_ln")),
        "clip_qkv": attn.get("clip_qkv"),
        "softmax_scale": attn.get("softmax_scale"),
        # llm-foundry's query sees itself and `window` keys before it; ours counts itself too.
        "sliding_window": None if window == -1 else window + 1,
        "alibi": bool(attn.get("alibi")),
        "alibi_bias_max": attn.get("alibi_bias_max"),
    }
    attn.refuse_unknown()
    return fields


def _rope(attn: _Keys) -> dict[str, Any]:
    """Our RoPE fields for `attn_config`'s (its rope_* keys are read only with rope: true).

    Both of llm-foundry's RoPEs are ours: `hf` is transformers' Llama rotary embedding
    (rotate-half pairing, no_scaling or linear), and `dail` (flash-attn's RotaryEmbedding, built
    with interleaved=False, so the same rotate-half pairing, and the same frequencies
    theta^(-2i/head_dim)) at `type: original` with positions in float32. Refused: xpos (a decay
    we lack), dail's positions in the model's dtype, and transformers' dynamic NTK scaling (it
    equals no_scaling up to max_seq_len, then changes the frequencies with the length)."""
    attn.accept(ROPE_KEYS)
    if not attn.get("rope"):
        return {"rope": False}
    impl, theta = attn.get("rope_impl"), attn.get("rope_theta")
    if isinstance(theta, bool) or not isinstance(theta, int | float) or theta <= 0:
        raise attn.refuse("rope_theta", "give a number > 0")
    scaling = None
    if impl == "dail":
        dail = {**ATTN_DEFAULTS["rope_dail_config"], **(attn.get("rope_dail_config") or {})}
        if dail["type"] != "original" or dail["pos_idx_in_fp32"] is not True or len(dail) != 3:
            raise attn.refuse(
                "rope_dail_config",
                "ours is type original with pos_idx_in_fp32 true (no xpos); set those",
            )
    elif impl == "hf":
        hf = {**ATTN_DEFAULTS["rope_hf_config"], **(attn.get("rope_hf_config") or {})}
        factor = hf["factor"]
        if (
            len(hf) != 2
            or hf["type"] not in ("no_scaling", "linear")
            or (
                hf["type"] == "linear"
                and (isinstance(factor, bool) or not isinstance(factor, int | float) or factor <= 0)
            )
        ):
            raise attn.refuse(
                "rope_hf_config",
                "ours is type no_scaling, or linear with a factor > 0 (dynamic: use no_scaling, "
                "the same up to max_seq_len)",
            )
        scaling = float(factor) if hf["type"] == "linear" else None
    else:
        raise attn.refuse("rope_impl", "use dail or hf")
    return {"rope": True, "rope_theta": float(theta), "rope_linear_scaling": scaling}


def _check_fc_type(keys: _Keys, key: str) -> None:
    """`fc_type` is torch's Linear: "torch" or {name: torch} (llm-foundry adds bias and device)."""
    fc_type = keys.get(key)
    name = fc_type.get("name") if isinstance(fc_type, Mapping) else fc_type
    extra = set(fc_type) - {"name", "bias", "device"} if isinstance(fc_type, Mapping) else set()
    if name not in ("torch", None) or extra:
        raise keys.refuse(
            key,
            "our Linear layers are torch's; use fc_type=torch (fp8 training: converters=[float8])",
        )


def _ffn(ffn: _Keys, top: _Keys) -> dict[str, Any]:
    """Our ffn fields for llm-foundry's `ffn_config` (mptmlp or mptglu, its activation) and the
    top-level `expansion_ratio` it falls back on for the width."""
    ffn_type = ffn.get("ffn_type")
    if ffn_type not in FFN_TYPES:
        raise ffn.refuse("ffn_type", FFN_REFUSED.get(ffn_type, "use mptmlp or mptglu"))
    act = ffn.get("ffn_act_fn")
    act = {"name": "gelu"} if act is None else act  # llm-foundry's default: exact GELU
    if isinstance(act, Mapping) and act.get("name") == "gelu":
        act = {"approximate": "none", **act}
    ffn_act = ACTS.get(tuple(sorted(act.items()))) if isinstance(act, Mapping) else None
    if ffn_act is None:
        raise ffn.refuse("ffn_act_fn", "ours is gelu (approximate none or tanh), silu or relu")
    return {
        "ffn_type": FFN_TYPES[ffn_type],
        "ffn_act": ffn_act,
        "expansion_ratio": _mlp_width(ffn, top),
    }


def _mlp_width(ffn: _Keys, top: _Keys) -> int:
    """Our `expansion_ratio` for llm-foundry's `ffn_hidden_size` or `expansion_ratio`."""
    _check_fc_type(ffn, "fc_type")
    ffn.accept(frozenset({"bias"}))  # llm-foundry sets it from no_bias for te_ln_mlp only
    d_model, hidden = top.get("d_model"), ffn.get("ffn_hidden_size")
    top.accept(frozenset({"expansion_ratio"}))  # llm-foundry ignores it given ffn_hidden_size
    keys, key = (top, "expansion_ratio") if hidden is None else (ffn, "ffn_hidden_size")
    if hidden is None:
        hidden = d_model * top.get("expansion_ratio")
    ffn.refuse_unknown()
    if hidden != int(hidden) or int(hidden) % d_model:
        raise keys.refuse(
            key, f"our MLP is a whole multiple of d_model ({d_model}) wide (expansion_ratio)"
        )
    return int(hidden) // d_model


def _init_std(init: _Keys) -> float | None:
    """Our `init_std` for llm-foundry's `init_config`: None is our kaiming_normal_(fan_in, relu),
    a number N(0, init_std) (its baseline_); both divide the residual projections by
    sqrt(2 * n_layers) as its init_div_is_residual=true does. UserError for an init we lack."""
    init.accept(frozenset({"verbose", "init_gain"}))  # kaiming with relu reads no gain
    if init.get("init_div_is_residual") is not True:  # a number (even 1) is its divisor
        raise init.refuse("init_div_is_residual", "ours divides by sqrt(2 * n_layers); set true")
    init.check(
        (
            ("emb_init_std", (None,), "ours draws the embedding like the other weights"),
            ("emb_init_uniform_lim", (None,), "ours draws the embedding like the other weights"),
        )
    )
    name, init_std = init.get("name"), init.get("init_std")
    if name == "kaiming_normal_":
        init.check(
            (
                ("fan_mode", ("fan_in",), "ours is kaiming_normal_ with fan_in"),
                ("init_nonlinearity", ("relu",), "ours is kaiming_normal_ for relu"),
            )
        )
        init.refuse_unknown()
        return None  # kaiming_normal_ reads no init_std
    init.accept(frozenset({"fan_mode", "init_nonlinearity"}))  # read by kaiming only
    if name != "baseline_":
        raise init.refuse("name", "ours is kaiming_normal_, or baseline_ with init_std")
    if isinstance(init_std, bool) or not isinstance(init_std, int | float) or init_std <= 0:
        raise init.refuse("init_std", "baseline_ needs init_std > 0")
    init.refuse_unknown()
    return float(init_std)


def _top_level(top: _Keys) -> dict[str, Any]:
    """Our fields read from llm-foundry's top-level keys (not attn, ffn or init)."""
    top.accept(NO_EFFECT | TRANSFORMERS_KEYS)
    top.check(TOP_FIXED)
    _check_fc_type(top, "fc_type")
    for key in ("d_model", "n_heads"):  # divided by below, before MPTConfig checks the rest
        value = top.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise top.refuse(key, "give a positive integer")
    if not isinstance(top.get("expansion_ratio"), int | float):
        raise top.refuse("expansion_ratio", "give a number")
    d_model, n_heads, no_bias = top.get("d_model"), top.get("n_heads"), top.get("no_bias")
    head_dim = top.get("head_dim")
    if head_dim is not None and (not isinstance(n_heads, int) or head_dim * n_heads != d_model):
        raise top.refuse("head_dim", "our heads are d_model // n_heads wide; remove head_dim")
    if top.get("attention_bias") not in (None, not no_bias):
        raise top.refuse("attention_bias", "our attention has biases exactly when no_bias=false")
    norm_type = top.get("norm_type")
    if str(norm_type).lower() not in NORM_TYPES:
        raise top.refuse("norm_type", "use one of " + ", ".join(NORM_TYPES))
    norm_type, low_precision = NORM_TYPES[norm_type.lower()]
    return {
        "d_model": d_model,
        "n_heads": n_heads,
        "n_layers": top.get("n_layers"),
        "max_seq_len": top.get("max_seq_len"),
        "vocab_size": top.get("vocab_size"),
        "no_bias": bool(no_bias),
        "norm_type": norm_type,
        "low_precision_layernorm": low_precision,
        "tie_word_embeddings": top.get("tie_word_embeddings"),
        "resid_pdrop": top.get("resid_pdrop"),
        "emb_pdrop": top.get("emb_pdrop"),
    }


def mpt_config_from_foundry(
    config: Mapping[str, Any], *, where: str = "model", weights_loaded: bool = False
) -> dict[str, Any]:
    """Our MPT model config (`model=`'s node: MPTConfig's fields and `_target_`) computing what
    llm-foundry's MPT of `config` computes: a train YAML's `model:` block, an llm-foundry or Hub
    config.json, a Composer checkpoint's HF config (module docstring).

    Every key is mapped, accepted for a stated reason, or refused with a UserError naming it as
    `where`.key (e.g. "model.attn_config.rope=True") and what to use instead; a key we do not
    know is refused too. `weights_loaded`: the weights will come from a checkpoint, so an
    `init_config` we cannot reproduce is accepted (with it false, it is refused).
    """
    config = _plain(config)
    if not isinstance(config, Mapping):
        raise UserError(f"{where} must be a mapping of llm-foundry MPT config keys, got {config!r}")
    top = _Keys({**TOP_DEFAULTS, **config}, where)
    fields = _top_level(top)
    attn = _Keys(_section(config, "attn_config", ATTN_DEFAULTS, where), f"{where}.attn_config")
    fields.update(_attention(attn, fields["n_heads"]))
    ffn = _Keys(
        _section(config, "ffn_config", {"ffn_type": "mptmlp"}, where), f"{where}.ffn_config"
    )
    fields.update(_ffn(ffn, top))
    init = _Keys(_section(config, "init_config", INIT_DEFAULTS, where), f"{where}.init_config")
    try:
        fields["init_std"] = _init_std(init)
    except UserError:
        if not weights_loaded:
            raise
        fields["init_std"] = None  # the checkpoint's weights replace any init
    # llm-foundry turns learned positions off whenever ALiBi or RoPE is on.
    learned = bool(top.get("learned_pos_emb"))
    fields["learned_pos_emb"] = learned and not fields["alibi"] and not fields["rope"]
    top.accept(frozenset({"attn_config", "ffn_config", "init_config"}))
    top.refuse_unknown()
    try:
        MPTConfig(**fields)  # its own checks (sizes, head counts), before anything is built
    except UserError as err:
        raise UserError(f"{where}: {err}") from None
    return {"_target_": MPT_TARGET, **fields}


# What llm-foundry 0.22's MPTConfig writes for the options our MPT has no field for (its
# defaults: they compute what ours does), so an export's config.json carries every key of theirs.
FOUNDRY_FIXED_TOP: dict[str, Any] = {
    "block_overrides": None,
    "embedding_fraction": 1.0,
    "fc_type": {"name": "torch"},
    "final_logit_softcapping": None,
    "head_dim": None,
    "init_device": "cpu",
    "logit_scale": None,
    "norm_eps": LAYER_NORM_EPS,
    "use_cache": False,
    "use_pad_tok_in_ffn": True,
}
FOUNDRY_FIXED_ATTN: dict[str, Any] = {
    "attn_impl": "torch",  # torch's kernels, as ours; "flash" would need the flash-attn package
    "attn_logit_softcapping": None,
    "attn_temperature_tuning": {"attn_scale": 0.0, "floor_scale": 8192},
    "attn_uses_sequence_id": False,
    "fused_qkv": True,
    "kv_dim": None,
    "nope": False,
    "qk_gn": False,
}
# Our fields that choose how a model runs, not what it computes: llm-foundry's dict does not
# carry them (mpt_config_from_foundry gives them their defaults back).
RUNTIME_FIELDS = ("attn_impl", "init_device", "compile")


def _foundry_rope(cfg: MPTConfig) -> dict[str, Any]:
    """attn_config's rope keys: llm-foundry's defaults with RoPE off (unread then), else its
    `hf` RoPE (transformers' Llama rotary embedding: ours, and runs without flash-attn)."""
    keys = {k: ATTN_DEFAULTS[k] for k in ROPE_KEYS}
    if not cfg.rope:
        return {"rope": False, **keys}
    scaling = cfg.rope_linear_scaling
    hf = dict(ATTN_DEFAULTS["rope_hf_config"])  # no_scaling
    if scaling is not None:
        hf = {"type": "linear", "factor": scaling}
    return {
        **keys,
        "rope": True,
        "rope_impl": "hf",
        "rope_theta": cfg.rope_theta,
        "rope_hf_config": hf,
    }


def mpt_config_to_foundry(cfg: MPTConfig, *, where: str = "model") -> dict[str, Any]:
    """llm-foundry's MPT config dict (the keys its MPTConfig takes and its config.json holds)
    for our `cfg`: the inverse of `mpt_config_from_foundry`, which reads it back to `cfg`'s
    fields (`RUNTIME_FIELDS` aside). Every key llm-foundry 0.22 writes is written, at its
    default where ours has no field for it. UserError for what llm-foundry's MPT lacks
    (infini-attention)."""
    if cfg.infini is not None:
        raise UserError(
            f"{where}.infini: neither llm-foundry's MPT nor transformers' has infini-attention, so "
            "no HF folder can hold this model; use our checkpoint (generate.py, serve.py read it)"
        )
    norm = {ours: name for name, ours in NORM_TYPES.items() if name != "triton_rmsnorm"}
    ffn: dict[str, Any] = {"fc_type": {"name": "torch"}, "ffn_type": "mpt" + cfg.ffn_type}
    if cfg.ffn_act != "gelu":  # absent: llm-foundry's exact GELU
        ffn["ffn_act_fn"] = dict(next(k for k, v in ACTS.items() if v == cfg.ffn_act))
    attn = {
        **FOUNDRY_FIXED_ATTN,
        **_foundry_rope(cfg),
        "alibi": cfg.alibi,
        "alibi_bias_max": cfg.alibi_bias_max,
        "attn_pdrop": cfg.attn_pdrop,
        "attn_type": "multihead_attention",
        "clip_qkv": cfg.clip_qkv,
        "qk_ln": cfg.qk_ln,
        "sliding_window_size": -1 if cfg.sliding_window is None else cfg.sliding_window - 1,
        "softmax_scale": cfg.softmax_scale,
    }
    if cfg.kv_n_heads != cfg.n_heads:
        attn.update(attn_type="grouped_query_attention", kv_n_heads=cfg.kv_n_heads)
    init = dict(INIT_DEFAULTS)
    if cfg.init_std is not None:
        init.update(name="baseline_", init_std=cfg.init_std)
    return {
        **FOUNDRY_FIXED_TOP,
        "d_model": cfg.d_model,
        "n_heads": cfg.n_heads,
        "n_layers": cfg.n_layers,
        "expansion_ratio": cfg.expansion_ratio,
        "max_seq_len": cfg.max_seq_len,
        "vocab_size": cfg.vocab_size,
        "resid_pdrop": cfg.resid_pdrop,
        "emb_pdrop": cfg.emb_pdrop,
        "learned_pos_emb": cfg.learned_pos_emb,
        "no_bias": cfg.no_bias,
        "attention_bias": not cfg.no_bias,
        "norm_type": norm[(cfg.norm_type, cfg.low_precision_layernorm)],
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attn_config": attn,
        "ffn_config": ffn,
        "init_config": init,
    }

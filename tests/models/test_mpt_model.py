"""MPTForCausalLM: causality, documents, loss, init, meta device, options, sampling, config errors."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from llmfoundry.models import MPTConfig, MPTForCausalLM
from llmfoundry.models.layers.position import positions_in_document
from llmfoundry.models.norms import LayerNorm

VOCAB = 97


def tiny(seed=0, **overrides) -> MPTForCausalLM:
    fields = dict(d_model=64, n_heads=4, n_layers=2, max_seq_len=48, vocab_size=VOCAB)
    fields.update(overrides)
    torch.manual_seed(seed)
    return MPTForCausalLM(MPTConfig(**fields))


IMPLS = ["torch", "sdpa"]
POSITIONS = [dict(alibi=True), dict(alibi=False)]


@pytest.mark.parametrize("attn_impl", IMPLS)
@pytest.mark.parametrize("positions", POSITIONS, ids=["alibi", "learned"])
def test_later_tokens_never_change_earlier_logits(attn_impl, positions):
    model = tiny(attn_impl=attn_impl, **positions).eval()
    ids = torch.randint(0, VOCAB, (2, 40))
    base = model(ids)
    for t in (0, 17, 39):
        changed = ids.clone()
        changed[:, t] = (changed[:, t] + 1) % VOCAB
        out = model(changed)
        torch.testing.assert_close(out[:, :t], base[:, :t], rtol=0, atol=1e-6)
        assert not torch.allclose(out[:, t], base[:, t])  # the change does reach position t


@pytest.mark.parametrize("attn_impl", IMPLS)
@pytest.mark.parametrize("positions", POSITIONS, ids=["alibi", "learned"])
def test_documents_are_isolated(attn_impl, positions):
    model = tiny(attn_impl=attn_impl, **positions).eval()
    ids = torch.randint(0, VOCAB, (2, 40))
    sid = torch.zeros(2, 40, dtype=torch.long)
    sid[:, 12:] = 1
    sid[:, 30:] = 2
    base = model(ids, sid)
    # An edit inside the first document changes nothing in the later ones.
    changed = ids.clone()
    changed[:, 3] = (changed[:, 3] + 1) % VOCAB
    out = model(changed, sid)
    torch.testing.assert_close(out[:, 12:], base[:, 12:], rtol=0, atol=1e-6)
    assert not torch.allclose(out[:, 3:12], base[:, 3:12])
    # Causality still holds inside a document.
    changed = ids.clone()
    changed[:, 20] = (changed[:, 20] + 1) % VOCAB
    torch.testing.assert_close(model(changed, sid)[:, :20], base[:, :20], rtol=0, atol=1e-6)
    # A packed document gets the logits it would get alone.
    torch.testing.assert_close(base[:, 12:30], model(ids[:, 12:30]), rtol=0, atol=1e-5)


def test_positions_in_document():
    sid = torch.tensor([[0, 0, 0, 1, 1, 2], [5, 5, 5, 5, 5, 5]])
    assert positions_in_document(sid).tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]]


def test_bad_inputs_are_refused():
    model = tiny(alibi=False)
    ids = torch.randint(0, VOCAB, (2, 8))
    with pytest.raises(ValueError, match=r"input_ids must be \[batch, seq\]"):
        model(ids[0])
    with pytest.raises(ValueError, match="sequence_id shape"):
        model(ids, torch.zeros(2, 7, dtype=torch.long))
    with pytest.raises(ValueError, match="exceeds max_seq_len 48"):
        model(torch.zeros(1, 49, dtype=torch.long))
    # ALiBi has no table to run out of: longer inputs extrapolate.
    assert tiny()(torch.zeros(1, 60, dtype=torch.long)).shape == (1, 60, VOCAB)


def test_loss_is_shifted_mean_over_counted_positions():
    torch.manual_seed(0)
    logits = torch.randn(2, 6, VOCAB)
    labels = torch.randint(0, VOCAB, (2, 6))
    labels[0, 2] = -100
    labels[1, 5] = -100
    counted = [(b, t) for b in range(2) for t in range(1, 6) if labels[b, t] != -100]
    expected = sum(
        F.cross_entropy(logits[b, t - 1], labels[b, t], reduction="sum") for b, t in counted
    ) / len(counted)
    torch.testing.assert_close(MPTForCausalLM.loss(logits, labels), expected)
    assert MPTForCausalLM.loss(logits, torch.full_like(labels, -100)).item() == 0.0
    with pytest.raises(ValueError, match="labels shape"):
        MPTForCausalLM.loss(logits, labels[:, 1:])


def test_overfits_one_batch():
    model = tiny(d_model=64, n_layers=2, max_seq_len=32, vocab_size=64)
    torch.manual_seed(1)
    ids = torch.randint(0, 64, (4, 32))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    first = None
    for _ in range(150):
        loss = model.loss(model(ids), ids)
        first = first if first is not None else loss.item()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert first > 4.0
    assert loss.item() < 0.05


def test_kaiming_init_with_scaled_residual_projections():
    model = tiny(d_model=256, n_layers=4, vocab_size=1000)
    block = model.transformer.blocks[0]
    relu_fan_in = math.sqrt(2 / 256)
    residual = relu_fan_in / math.sqrt(2 * 4)
    assert block.attn.Wqkv.weight.std().item() == pytest.approx(relu_fan_in, rel=0.03)
    assert block.ffn.up_proj.weight.std().item() == pytest.approx(relu_fan_in, rel=0.03)
    assert block.attn.out_proj.weight.std().item() == pytest.approx(residual, rel=0.03)
    down_fan_in = math.sqrt(2 / 1024) / math.sqrt(2 * 4)
    assert block.ffn.down_proj.weight.std().item() == pytest.approx(down_fan_in, rel=0.03)
    assert model.transformer.wte.weight.std().item() == pytest.approx(relu_fan_in, rel=0.03)
    assert torch.equal(block.norm_1.weight, torch.ones(256))
    std_model = tiny(d_model=256, n_layers=4, vocab_size=1000, init_std=0.02)
    assert std_model.transformer.blocks[0].attn.Wqkv.weight.std().item() == pytest.approx(
        0.02, rel=0.03
    )
    assert std_model.transformer.blocks[0].attn.out_proj.weight.std().item() == pytest.approx(
        0.02 / math.sqrt(8), rel=0.03
    )


def test_meta_device_then_materialise_equals_cpu_init():
    on_cpu = tiny(seed=3, no_bias=False)
    on_meta = tiny(seed=3, no_bias=False, init_device="meta")
    assert all(p.is_meta for p in on_meta.parameters())
    on_meta.to_empty(device="cpu")
    torch.manual_seed(3)
    on_meta.init_weights()
    for (name, a), b in zip(
        on_cpu.state_dict().items(), on_meta.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name
    ids = torch.randint(0, VOCAB, (1, 10))
    torch.testing.assert_close(on_meta(ids), on_cpu(ids))


def test_parameter_names_follow_transformers():
    names = set(dict(tiny(no_bias=False, alibi=False, qk_ln=True).named_parameters()))
    for expected in [
        "transformer.wte.weight",
        "transformer.wpe.weight",
        "transformer.blocks.1.norm_1.weight",
        "transformer.blocks.1.norm_1.bias",
        "transformer.blocks.1.attn.Wqkv.weight",
        "transformer.blocks.1.attn.Wqkv.bias",
        "transformer.blocks.1.attn.q_ln.weight",
        "transformer.blocks.1.attn.k_ln.weight",
        "transformer.blocks.1.attn.out_proj.weight",
        "transformer.blocks.1.norm_2.weight",
        "transformer.blocks.1.ffn.up_proj.weight",
        "transformer.blocks.1.ffn.down_proj.bias",
        "transformer.norm_f.weight",
    ]:
        assert expected in names
    assert not any("bias" in n for n, _ in tiny().named_parameters())  # no_bias covers norms too


def test_output_head_is_tied_to_embedding():
    model = tiny()
    ids = torch.randint(0, VOCAB, (1, 5))
    with torch.no_grad():
        model.transformer.wte.weight[7].zero_()
    assert torch.all(model(ids)[..., 7] == 0)


def test_num_params_and_flops_per_token():
    model = tiny(alibi=False, no_bias=False)
    d, n_layers, hidden = 64, 2, 256
    block = 4 * d * d + 2 * d * hidden + (3 * d + d + hidden + d) + 4 * d
    embeddings = VOCAB * d + 48 * d
    assert model.num_params() == n_layers * block + embeddings + 2 * d
    assert model.num_params(exclude_embeddings=True) == n_layers * block + 2 * d
    matmul_weights = sum(
        m.weight.numel() for m in model.transformer.blocks.modules() if isinstance(m, nn.Linear)
    )
    n_matmul = matmul_weights + VOCAB * d  # block projections + the tied output head
    assert model.flops_per_token(48) == 6 * n_matmul + 12 * n_layers * d * 48


def test_low_precision_layernorm_runs_in_autocast_dtype():
    torch.manual_seed(0)
    x = torch.randn(2, 5, 32)
    lp, full = LayerNorm(32, True, low_precision=True), LayerNorm(32, True, low_precision=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert lp(x).dtype == torch.bfloat16
        assert full(x).dtype == torch.float32
        torch.testing.assert_close(lp(x).float(), full(x), rtol=0.02, atol=0.02)
    assert lp(x).dtype == torch.float32  # outside autocast it is an ordinary LayerNorm
    torch.testing.assert_close(lp(x), full(x))


@pytest.mark.parametrize("attn_impl", IMPLS)
@pytest.mark.parametrize("low_precision", [True, False])
def test_options_run_under_bf16_autocast(attn_impl, low_precision):
    model = tiny(
        attn_impl=attn_impl, qk_ln=True, clip_qkv=0.5, low_precision_layernorm=low_precision
    )
    ids = torch.randint(0, VOCAB, (2, 16))
    reference = model(ids)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(ids)
        loss = model.loss(logits, ids)
    loss.backward()
    assert logits.dtype == torch.bfloat16 and torch.isfinite(loss)
    assert (reference - logits.float()).abs().mean() < 0.1 * reference.abs().mean()


def test_qk_ln_and_clip_qkv_change_the_computation():
    ids = torch.randint(0, VOCAB, (1, 12))
    model = tiny(qk_ln=True)
    base = model(ids)
    with torch.no_grad():
        model.transformer.blocks[0].attn.q_ln.weight.mul_(3.0)
    assert not torch.allclose(model(ids), base)
    unclipped, clipped = tiny(), tiny(clip_qkv=0.1)
    clipped.load_state_dict(unclipped.state_dict())
    assert not torch.allclose(clipped(ids), unclipped(ids))
    wide = tiny(clip_qkv=1e6)
    wide.load_state_dict(unclipped.state_dict())
    torch.testing.assert_close(wide(ids), unclipped(ids))


def test_dropout_is_active_only_in_training():
    model = tiny(attn_pdrop=0.3, resid_pdrop=0.3, emb_pdrop=0.3)
    ids = torch.randint(0, VOCAB, (1, 12))
    assert not torch.allclose(model(ids), model(ids))
    model.eval()
    torch.testing.assert_close(model(ids), model(ids))


SHAPE = dict(n_layers=1)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            dict(d_model=100, n_heads=3),
            r"d_model \(100\) must be divisible by MPTConfig.n_heads \(3\)",
        ),
        (dict(d_model=0, n_heads=4), "d_model must be a positive integer"),
        (dict(d_model=64, n_heads=4, vocab_size=-5), "vocab_size must be a positive integer"),
        (dict(d_model=64, n_heads=4, max_seq_len=2.5), "max_seq_len must be a positive integer"),
        (dict(d_model=64, n_heads=4, learned_pos_emb=True), "alibi and MPTConfig.learned_pos_emb"),
        (dict(d_model=64, n_heads=4, alibi=False, learned_pos_emb=False), "no position"),
        (dict(d_model=64, n_heads=4, attn_pdrop=1.0), r"attn_pdrop must be in \[0, 1\)"),
        (dict(d_model=64, n_heads=4, clip_qkv=0), "clip_qkv must be null or > 0"),
        (dict(d_model=64, n_heads=4, init_std=-1.0), "init_std must be null"),
        (dict(d_model=64, n_heads=4, alibi_bias_max=0), "alibi_bias_max must be > 0"),
        (
            dict(d_model=64, n_heads=4, init_device="cuda"),
            "init_device must be one of 'cpu', 'meta'",
        ),
    ],
)
def test_config_errors_name_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        MPTConfig(**SHAPE, **fields)


def test_learned_pos_emb_follows_alibi():
    assert MPTConfig(d_model=64, n_heads=4, n_layers=1).learned_pos_emb is False
    assert MPTConfig(d_model=64, n_heads=4, n_layers=1, alibi=False).learned_pos_emb is True

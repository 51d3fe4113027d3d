"""Infini-attention: against a naive per-segment reference, causality, isolation, its gate group."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from llmfoundry.models import MPTConfig, MPTForCausalLM
from llmfoundry.models.layers.attention import AttentionMasks, torch_attention
from llmfoundry.models.layers.position import ALiBi, alibi_slopes
from llmfoundry.models.mpt.config import InfiniConfig
from llmfoundry.models.mpt.infini import infini_attention, memory_attention
from llmfoundry.optim import DecoupledAdamW, build_param_groups
from llmfoundry.optim.param_groups import DECOUPLED_DECAY, OWN_GROUP

REPO = Path(__file__).resolve().parents[2]
EPS = 1e-6
SCALE = 0.3


def naive(q, k, v, gate, segment_len, update, slopes):
    """Straight from the equations: per row, per head, per segment, a fresh memory per row."""
    batch, n_heads, seq_len, _ = q.shape
    groups = n_heads // k.shape[1]
    rows = []
    for b in range(batch):
        heads = []
        for h in range(n_heads):
            kh = h // groups
            memory = torch.zeros(q.shape[-1], v.shape[-1], dtype=torch.float64)
            norm = torch.zeros(q.shape[-1], dtype=torch.float64)
            segments = []
            for start in range(0, seq_len, segment_len):
                Q = q[b, h, start : start + segment_len]
                K = k[b, kh, start : start + segment_len]
                V = v[b, kh, start : start + segment_len]
                sQ, sK = F.elu(Q) + 1, F.elu(K) + 1
                a_mem = (sQ @ memory) / ((sQ @ norm)[:, None] + EPS)
                pos = torch.arange(Q.shape[0])
                dist = pos[:, None] - pos[None, :]
                scores = SCALE * Q @ K.T - slopes[h] * dist
                scores = scores.masked_fill(dist < 0, float("-inf"))
                a_dot = torch.softmax(scores, dim=-1) @ V
                if update == "linear":
                    memory = memory + sK.T @ V
                else:
                    memory = memory + sK.T @ (V - (sK @ memory) / ((sK @ norm)[:, None] + EPS))
                norm = norm + sK.sum(0)
                g = torch.sigmoid(gate[h])
                segments.append(g * a_mem + (1 - g) * a_dot)
            heads.append(torch.cat(segments))
        rows.append(torch.stack(heads))
    return torch.stack(rows)


def _local(q, k, v, mask):
    return torch_attention(q, k, v, mask, 0.0, SCALE)


@pytest.mark.parametrize("update", ["linear", "delta"])
@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("seq_len", [24, 22])  # whole segments, and a short last one
def test_equals_naive_reference_forward_and_gradients(update, kv_heads, seq_len):
    # Ours in float32 (the product's precision) against the reference in float64.
    torch.manual_seed(0)
    shapes = [(2, 4, seq_len, 8), (2, kv_heads, seq_len, 8), (2, kv_heads, seq_len, 8), (4,)]
    ours_in = [torch.randn(s, requires_grad=True) for s in shapes]
    ref_in = [t.detach().double().requires_grad_() for t in ours_in]
    masks = AttentionMasks(n_heads=4, max_seq_len=8, alibi=ALiBi(8))
    q, k, v, gate = ours_in
    ours = infini_attention(
        q, k, v, masks(None, q.device, q.dtype), gate, 8, update, EPS, None, _local
    )
    ref = naive(*ref_in, 8, update, alibi_slopes(4).double())
    torch.testing.assert_close(ours, ref.float(), rtol=0, atol=2e-5)
    weights = torch.randn_like(ours)
    grads = torch.autograd.grad((ours * weights).sum(), ours_in)
    ref_grads = torch.autograd.grad((ref * weights.double()).sum(), ref_in)
    for name, g, r in zip("qkvg", grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r.float(), rtol=1e-4, atol=2e-5, msg=name)


def _model(**infini):
    options = {"segment_len": 8, **infini}
    torch.manual_seed(0)
    cfg = MPTConfig(
        d_model=32, n_heads=4, n_layers=2, max_seq_len=64, vocab_size=64, infini=options
    )
    return MPTForCausalLM(cfg)


@pytest.mark.parametrize("update", ["linear", "delta"])
def test_causal_across_segments(update):
    model = _model(update=update)
    torch.manual_seed(1)
    ids = torch.randint(0, 64, (2, 30))
    changed = ids.clone()
    changed[:, 13] = (ids[:, 13] + 1) % 64
    a, b = model(ids), model(changed)
    torch.testing.assert_close(a[:, :13], b[:, :13], rtol=0, atol=0)
    assert not torch.allclose(a[:, 13:], b[:, 13:])
    assert not torch.allclose(a[:, 24:], b[:, 24:])  # the change reaches later segments


def test_one_segment_with_closed_gate_is_plain_attention():
    infini = _model(gate_init=-40.0)
    torch.manual_seed(0)
    plain = MPTForCausalLM(MPTConfig(d_model=32, n_heads=4, n_layers=2, vocab_size=64))
    missing = plain.load_state_dict(infini.state_dict(), strict=False).unexpected_keys
    assert sorted(missing) == [f"transformer.blocks.{i}.attn.gate" for i in range(2)]
    ids = torch.randint(0, 64, (3, 8))
    torch.testing.assert_close(infini(ids), plain(ids), rtol=0, atol=1e-5)


def test_no_state_leaks_between_rows_or_calls():
    model = _model()
    assert list(model.buffers()) == []  # the memory is never module state
    torch.manual_seed(2)
    a, b, c = (torch.randint(0, 64, (1, 40)) for _ in range(3))
    first = model(torch.cat([a, b]))
    MPTForCausalLM.loss(first, torch.cat([a, b])).backward()
    again = model(torch.cat([a, c]))
    torch.testing.assert_close(again[0], first[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(model(a)[0], first[0], rtol=0, atol=1e-6)


def test_documents_do_not_share_memory():
    model = _model()
    torch.manual_seed(3)
    ids = torch.randint(0, 64, (1, 40))
    sid = torch.zeros(1, 40, dtype=torch.long)
    sid[:, 13:] = 1  # document 1 starts mid-segment and spans three more segments
    changed = ids.clone()
    changed[:, :13] = (ids[:, :13] + 5) % 64
    a, b = model(ids, sid), model(changed, sid)
    torch.testing.assert_close(a[:, 13:], b[:, 13:], rtol=0, atol=1e-6)
    assert not torch.allclose(a[:, :13], b[:, :13])
    # Without document ids, document 1 does read document 0 (local attention and memory).
    assert not torch.allclose(model(ids)[:, 13:], a[:, 13:])


@pytest.mark.parametrize("truncate_every", [None, 1])
def test_gradient_flows_through_memory_unless_truncated(truncate_every):
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 24, 4, requires_grad=True) for _ in range(3))
    out = memory_attention(q, k, v, None, 8, "delta", EPS, truncate_every)
    (grad_k,) = torch.autograd.grad(out[:, :, 16:].sum(), (k,), materialize_grads=True)
    first_segment = grad_k[:, :, :8].abs().sum()
    assert (first_segment > 0) == (truncate_every is None)


def test_memory_is_float32_under_autocast():
    q, k, v = (torch.randn(1, 2, 16, 4, dtype=torch.bfloat16) for _ in range(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = memory_attention(q, k, v, None, 8, "linear", EPS, None)
    assert out.dtype == torch.float32
    assert torch.isfinite(out).all() and (out[:, :, :8] == 0).all()  # empty memory reads 0


def test_gate_has_its_own_group_lr_and_no_decay():
    model = _model(gate_lr=1e-2, gate_init=1.5)
    groups = build_param_groups(model)
    (gate_group,) = [g for g in groups if g.get(OWN_GROUP) == "infini_gate"]
    assert gate_group["param_names"] == [f"transformer.blocks.{i}.attn.gate" for i in range(2)]
    assert all((p == 1.5).all() for p in gate_group["params"])
    others = {n for g in groups if g is not gate_group for n in g["param_names"]}
    assert not any(n.endswith(".gate") for n in others)
    opt = DecoupledAdamW(groups, lr=1e-3, weight_decay=0.1)
    (gate_opt,) = [g for g in opt.param_groups if g.get(OWN_GROUP) == "infini_gate"]
    assert gate_opt["lr"] == gate_opt["initial_lr"] == 1e-2 and gate_opt[DECOUPLED_DECAY] == 0.0
    assert all(g[DECOUPLED_DECAY] == 0.1 for g in opt.param_groups if g is not gate_opt)


@pytest.mark.parametrize("option", ["linear", "delta"])
def test_hydra_option_selects_infini(option):
    with initialize_config_dir(str(REPO / "conf"), version_base=None):
        cfg = compose("train", overrides=[f"+model/infini={option}", "model.infini.segment_len=16"])
    config = instantiate(cfg.model)
    assert config.infini == InfiniConfig(segment_len=16, update=option)
    model = MPTForCausalLM(config)
    assert model(torch.randint(0, 10, (1, 20))).shape == (1, 20, config.vocab_size)


@pytest.mark.parametrize(
    ("infini", "message"),
    [
        ({"segment_len": 0}, r"infini.segment_len must be a positive integer"),
        ({"segment_len": 8, "update": "sum"}, r"infini.update must be one of 'linear', 'delta'"),
        ({"segment_len": 8, "size": 3}, r"unknown key\(s\) \['size'\]"),
        ({"segment_len": 8, "truncate_every": 0}, r"truncate_every must be a positive integer"),
        ({"segment_len": 8, "eps": 0}, r"infini.eps must be > 0"),
    ],
)
def test_bad_infini_options_are_named(infini, message):
    with pytest.raises(ValueError, match=message):
        MPTConfig(d_model=32, n_heads=4, n_layers=1, infini=infini)


# Rows of packed documents (lengths) for segment_len 8: ends mid-segment (13, 5), ends at a
# segment boundary (16, 8 from position 8), spans several segments from mid-segment (27, 19),
# one-token and short documents (1, 3), and documents that start at a boundary.
PACKINGS = [[13, 16, 27, 3, 5], [5, 27, 3, 13, 16], [8, 19, 1, 20, 16], [64]]


@pytest.mark.parametrize("alibi", [True, False])
@pytest.mark.parametrize("update", ["linear", "delta"])
def test_packed_document_equals_document_alone(update, alibi):
    # The converse of isolation: every token of a packed document sees exactly what it would
    # see alone (the same local segments and the same memory), whatever is packed around it.
    torch.manual_seed(0)
    model = MPTForCausalLM(
        MPTConfig(
            d_model=32,
            n_heads=4,
            n_layers=2,
            max_seq_len=64,
            vocab_size=64,
            alibi=alibi,
            infini={"segment_len": 8, "update": update},
        )
    )
    torch.manual_seed(4)
    ids = torch.randint(0, 64, (len(PACKINGS), 64))
    sid = torch.tensor([[d for d, n in enumerate(row) for _ in range(n)] for row in PACKINGS])
    with torch.no_grad():
        packed = model(ids, sid)
        for row, lengths in enumerate(PACKINGS):
            start = 0
            for n in lengths:
                alone = model(ids[row : row + 1, start : start + n])[0]
                got = packed[row, start : start + n]
                torch.testing.assert_close(got, alone, rtol=0, atol=1e-5, msg=f"{row}:{start}+{n}")
                start += n

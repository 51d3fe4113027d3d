"""ALiBi against transformers' MPT, the attention kernels against each other, the bias cache."""

import pytest
import torch
from torch.profiler import ProfilerActivity, profile
from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

from llmfoundry.models import MPTConfig, MPTForCausalLM
from llmfoundry.models.generation import GenerationConfig, generate
from llmfoundry.models.layers import attention
from llmfoundry.models.layers.attention import AttentionMasks
from llmfoundry.models.layers.kernels import ATTN_IMPLS
from llmfoundry.models.layers.position import ALiBi, alibi_slopes, causal_alibi_bias
from llmfoundry.models.mpt.parallelize import _PartsExchange


@pytest.mark.parametrize("n_heads", [1, 3, 12, 16, 24])
@pytest.mark.parametrize("alibi_bias_max", [8, 4])
def test_alibi_slopes_equal_transformers(n_heads, alibi_bias_max):
    # transformers' tensor for two positions is [-slope, 0] per head.
    hf = build_mpt_alibi_tensor(n_heads, 2, alibi_bias_max=alibi_bias_max)
    assert torch.equal(alibi_slopes(n_heads, alibi_bias_max), -hf[:, 0, 0])


def test_alibi_slopes_follow_reference_formula():
    # 12 heads is not a power of two: slopes of 16 heads, odd positions first, then even, cut at 12.
    m16 = torch.arange(1, 17, dtype=torch.float32) * 0.5
    s16 = 1.0 / 2**m16
    expected = torch.cat([s16[1::2], s16[::2]])[:12]
    assert torch.equal(alibi_slopes(12, 8), expected)
    assert alibi_slopes(8, 8).tolist() == [1 / 2**i for i in range(1, 9)]


@pytest.mark.parametrize("n_heads", [1, 3, 12, 16, 24])
def test_alibi_bias_equals_transformers(n_heads):
    seq_len = 37
    ours = causal_alibi_bias(n_heads, seq_len, 8)[0]  # [H, L, L], relative to the query
    hf = build_mpt_alibi_tensor(n_heads, seq_len)  # [H, 1, L], relative to the last key
    # The last query's row is the same tensor exactly.
    assert torch.equal(ours[:, -1, :], hf[:, 0, :])
    # Every other row differs by a constant per row, so the attention weights are the same.
    future = torch.ones(seq_len, seq_len, dtype=torch.bool).triu(1)
    hf_full = hf.expand(n_heads, seq_len, seq_len).masked_fill(future, float("-inf"))
    torch.testing.assert_close(ours.softmax(-1), hf_full.softmax(-1), rtol=0, atol=1e-6)
    assert torch.isneginf(ours[:, future]).all()
    assert (ours.diagonal(dim1=-2, dim2=-1) == 0).all()


def _pair(**overrides):
    """Two models with the same weights, one per attention kernel."""
    base = dict(d_model=64, n_heads=4, n_layers=2, max_seq_len=48, vocab_size=101)
    base.update(overrides)
    torch.manual_seed(0)
    ref = MPTForCausalLM(MPTConfig(attn_impl="torch", **base))
    fast = MPTForCausalLM(MPTConfig(attn_impl="sdpa", **base))
    fast.load_state_dict(ref.state_dict())
    return ref, fast


def _sequence_id(batch, seq_len):
    """Three documents per row, with different boundaries in each row."""
    sid = torch.zeros(batch, seq_len, dtype=torch.long)
    for row in range(batch):
        cut1, cut2 = 5 + 3 * row, 20 + row
        sid[row, cut1:] = 1
        sid[row, cut2:] = 2
    return sid


# Options every kernel must honour; each agrees with `torch` in fp32 within TOLERANCE.
OPTIONS = {
    "mha": {},
    "gqa": {"kv_n_heads": 2},
    "mqa": {"kv_n_heads": 1},
    "qk_ln": {"qk_ln": True},
    "clip_qkv": {"clip_qkv": 0.5},
    "softmax_scale": {"softmax_scale": 0.3},
    "sliding_window": {"sliding_window": 6},
    "all": {
        "kv_n_heads": 2,
        "qk_ln": True,
        "clip_qkv": 0.5,
        "softmax_scale": 0.3,
        "sliding_window": 9,
    },
}
TOLERANCE = {"sdpa": 1e-5}


@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("alibi", [True, False])
@pytest.mark.parametrize("use_sequence_id", [False, True])
def test_torch_and_sdpa_agree(option, alibi, use_sequence_id):
    ref, fast = _pair(alibi=alibi, no_bias=alibi, **OPTIONS[option])
    torch.manual_seed(1)
    ids = torch.randint(0, 101, (3, 40))
    sid = _sequence_id(3, 40) if use_sequence_id else None
    out_ref, out_fast = ref(ids, sid), fast(ids, sid)
    atol = TOLERANCE["sdpa"]
    torch.testing.assert_close(out_fast, out_ref, rtol=0, atol=atol)
    MPTForCausalLM.loss(out_ref, ids).backward()
    MPTForCausalLM.loss(out_fast, ids).backward()
    for (name, p_ref), p_fast in zip(ref.named_parameters(), fast.parameters(), strict=True):
        torch.testing.assert_close(p_fast.grad, p_ref.grad, rtol=0, atol=atol, msg=name)


def test_sdpa_bias_built_once_and_reused(monkeypatch):
    builds = []

    def counting(*args, **kwargs):
        builds.append(args)
        return causal_alibi_bias(*args, **kwargs)

    monkeypatch.setattr(attention, "causal_alibi_bias", counting)
    torch.manual_seed(0)
    model = MPTForCausalLM(
        MPTConfig(d_model=32, n_heads=4, n_layers=2, max_seq_len=32, vocab_size=50)
    )
    ids = torch.randint(0, 50, (2, 16))
    for length in (16, 16, 9):
        model(ids[:, :length])
    model(ids, _sequence_id(2, 16))
    generate(model, ids[:, :4], configs=GenerationConfig(max_new_tokens=6, temperature=0))
    assert len(builds) == 1, "the ALiBi/causal bias must be built once, not per step"
    assert builds[0][1] == 32  # built for max_seq_len, sliced for shorter inputs
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(ids)
    assert len(builds) == 2  # a new dtype needs its own copy
    assert not any("masks" in k for k in model.state_dict())


def test_unknown_attn_impl_lists_allowed():
    with pytest.raises(ValueError, match=r"attn_impl='magic'.*'torch', 'sdpa'"):
        MPTConfig(d_model=32, n_heads=4, n_layers=1, attn_impl="magic")


@pytest.mark.parametrize("impl", ["torch", "sdpa"])
@pytest.mark.parametrize("alibi", [True, False])
@pytest.mark.parametrize("use_sequence_id", [False, True])
@pytest.mark.parametrize("window", [None, 5])
def test_queries_are_the_last_key_positions(impl, alibi, use_sequence_id, window):
    # The seam a KV cache uses: the new queries with every key give the tail of the full output.
    torch.manual_seed(0)
    masks = AttentionMasks(
        n_heads=4, max_seq_len=16, alibi=ALiBi(8) if alibi else None, window=window
    )
    q = torch.randn(3, 4, 40, 8)
    k, v = torch.randn(3, 2, 40, 8), torch.randn(3, 2, 40, 8)
    sid = _sequence_id(3, 40) if use_sequence_id else None
    fn = ATTN_IMPLS[impl]
    full = fn(q, k, v, masks(sid, q.device, q.dtype), 0.0, 0.35)
    for q_len in (1, 7):
        tail = fn(q[:, :, -q_len:], k, v, masks(sid, q.device, q.dtype), 0.0, 0.35)
        torch.testing.assert_close(tail, full[:, :, -q_len:], rtol=0, atol=1e-6)


@pytest.mark.parametrize("kv_n_heads", [0, 3, 8, True])
def test_kv_n_heads_must_divide_n_heads(kv_n_heads):
    with pytest.raises(ValueError, match=r"kv_n_heads must be a positive divisor of n_heads \(4\)"):
        MPTConfig(d_model=32, n_heads=4, n_layers=1, kv_n_heads=kv_n_heads)


def test_gqa_shrinks_the_kv_projection_and_flops():
    full = MPTForCausalLM(MPTConfig(d_model=64, n_heads=8, n_layers=1, vocab_size=10))
    mqa = MPTForCausalLM(MPTConfig(d_model=64, n_heads=8, n_layers=1, vocab_size=10, kv_n_heads=1))
    assert full.transformer.blocks[0].attn.Wqkv.weight.shape == (3 * 64, 64)
    assert mqa.transformer.blocks[0].attn.Wqkv.weight.shape == (64 + 2 * 8, 64)
    saved = 2 * (64 - 8) * 64
    assert full.num_params() - mqa.num_params() == saved
    assert full.flops_per_token(16) - mqa.flops_per_token(16) == 6 * saved


def test_sliding_window_hides_keys_window_or_more_back():
    bias = causal_alibi_bias(2, 6, None, window=3)[0, 0]
    visible = torch.isfinite(bias)
    expected = torch.tensor([[0 <= i - j < 3 for j in range(6)] for i in range(6)])
    assert torch.equal(visible, expected)
    with pytest.raises(ValueError, match="sliding_window must be null"):
        MPTConfig(d_model=32, n_heads=4, n_layers=1, sliding_window=0)


@pytest.mark.parametrize(
    ("tp", "widths"),
    [(2, (32, 16, 16)), (3, (36, 12, 12)), (4, (64, 64, 64)), (4, (48, 16, 16))],
)
def test_the_wqkv_exchange_gives_each_rank_its_heads_q_k_and_v(tp, widths):
    """The column exchange of MPT's tensor-parallel Wqkv (models/mpt/parallelize.py), its
    all-to-all simulated in this process: column-split as ColwiseParallel splits it, then
    exchanged, rank r holds the r-th tp-th of q, of k and of v, including when a rank's columns
    straddle the q/k or k/v boundary (3 ranks of 60 columns; 4 of 48 + 16 + 16)."""
    whole = torch.randn(2, 5, sum(widths))  # [batch, seq, q | k | v]
    held = sum(widths) // tp
    ranks = [_PartsExchange(widths, _Mesh(tp, r)) for r in range(tp)]
    sent = [
        ex.pack(whole[..., r * held : (r + 1) * held]).split(ex.send_sizes)
        for r, ex in enumerate(ranks)
    ]
    q, k, v = whole.split(widths, dim=-1)
    for r, ex in enumerate(ranks):
        got = torch.cat([sent[src][r] for src in range(tp)])
        expected = torch.cat([part.chunk(tp, dim=-1)[r] for part in (q, k, v)], dim=-1)
        assert torch.equal(ex.unpack(got).view(2, 5, held), expected)


class _Mesh:
    """The two things `_PartsExchange` asks of a DeviceMesh, without a process group."""

    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def get_local_rank(self) -> int:
        return self._rank

    def get_group(self) -> None:
        return None


def test_the_mask_of_a_head_range_is_that_range_of_the_whole_mask():
    """Tensor parallelism gives each rank's mask a range of heads: ALiBi slopes and bias are
    those of the whole model's heads in that range, for every kernel's way of reading them."""
    whole = AttentionMasks(8, 16, ALiBi())
    part = AttentionMasks(8, 16, ALiBi())
    part.select_heads(2, 4)
    sequence_id = torch.tensor([[0] * 6 + [1] * 10])
    full_mask = whole(sequence_id, torch.device("cpu"), torch.float32)
    part_mask = part(sequence_id, torch.device("cpu"), torch.float32)
    assert torch.equal(part_mask.alibi_slopes, full_mask.alibi_slopes[2:4])
    assert torch.equal(part_mask.dense_bias(16, 16), full_mask.dense_bias(16, 16)[:, 2:4])
    with pytest.raises(ValueError, match=r"heads \[6, 10\) are not within the 8 heads"):
        part.select_heads(6, 10)


def _peak_bytes(build):
    """(The most CPU memory allocated at once while `build()` ran, its result), from the
    profiler's allocation and free events."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = build()
    events = prof.profiler.kineto_results.events()
    changes = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    live = peak = 0
    for _, change in changes:
        live += change
        peak = max(peak, live)
    return peak, result


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("alibi", "window"), [(ALiBi(8), None), (None, 100), (ALiBi(8), 100)])
def test_the_cached_bias_is_built_for_its_heads_in_its_dtype_within_twice_its_size(
    dtype, alibi, window
):
    """mpt-30b's bias at 8k is 7 GiB in bf16; building all heads in float32 and int64 first
    took ~35 GiB. Built only for a tensor-parallel rank's heads, in the target dtype, the
    build peaks at most at twice the result."""
    masks = AttentionMasks(8, 256, alibi, window)
    masks.select_heads(2, 4)
    peak, bias = _peak_bytes(lambda: masks.causal_bias(256, torch.device("cpu"), dtype))
    assert bias.shape == (1, 2 if alibi else 1, 256, 256) and bias.dtype == dtype
    assert 0 < peak <= 2 * bias.nbytes, peak / bias.nbytes


def test_a_kernel_product_is_built_once_per_forward_at_its_lengths():
    """`AttentionMask.cached` with lengths: one build however many layers ask, another when
    asked at other lengths; the model's lengths let the kernel's `prepare` build it before the
    blocks run."""
    builds = []
    mask = AttentionMasks(4, 16, ALiBi())(None, torch.device("cpu"), torch.float32)
    for lengths in [(16, 16)] * 3 + [(1, 16)] * 2:
        mask.cached("product", lambda lengths=lengths: builds.append(lengths), lengths)
    assert builds == [(16, 16), (1, 16)]
    masks = AttentionMasks(4, 16, ALiBi(), prepare=attention.prepare_dense)
    masks(_sequence_id(2, 16), torch.device("cpu"), torch.float32, (16, 16))
    assert masks.cached is not None  # built in the model's forward, before any block

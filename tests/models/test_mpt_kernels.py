"""flex and flash against the `torch` reference; flash's glue on CPU with the kernel written out.

Tolerances (fp32 unless noted), each against `torch`:
  sdpa  1e-5 forward and gradients (test_mpt_attention.py)
  flex  1e-5 forward on CPU (no CPU backward exists); on GPU bf16 forward 2e-2
  flash glue (the kernel's semantics in fp32) 1e-5; the kernel on GPU in bf16 2e-2 forward and
        gradients (relative to the gradients' scale)
"""

import math
import sys

import pytest
import torch

from llmfoundry.distributed import SingleDevice
from llmfoundry.models import MPTConfig, MPTForCausalLM
from llmfoundry.models.generation import Decoder, GenerationConfig, generate, left_pad
from llmfoundry.models.layers import attention, flash
from llmfoundry.models.layers.attention import AttentionMasks, torch_attention
from llmfoundry.models.layers.flex import flex_attention
from llmfoundry.models.layers.kernels import DENSE_BIAS_IMPLS
from llmfoundry.models.layers.position import ALiBi
from llmfoundry.models.mpt.infini import infini_attention
from llmfoundry.utils.errors import UserError


def _sequence_id(batch, seq_len, pad=0):
    """Three documents per row at different cuts, then `pad` padding tokens (id -1)."""
    sid = torch.zeros(batch, seq_len, dtype=torch.long)
    for row in range(batch):
        sid[row, 5 + 3 * row :] = 1
        sid[row, 20 + row :] = 2
        if pad:
            sid[row, seq_len - pad - row :] = -1
    return sid


def _qkv(batch=3, heads=4, kv_heads=2, seq=40, dim=8, q_len=None):
    torch.manual_seed(0)
    q = torch.randn(batch, heads, q_len or seq, dim)
    return q, torch.randn(batch, kv_heads, seq, dim), torch.randn(batch, kv_heads, seq, dim)


# --- flash: the documented kernel semantics, written out, to test the glue on CPU -----------


def _flash_reference(q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes):
    """One sequence of flash-attn: q [Lq, H, D], k/v [Lk, Hkv, D]; bottom-right causal."""
    assert dropout_p == 0 and causal
    q_len, k_len, heads = q.shape[0], k.shape[0], q.shape[1]
    k = k.repeat_interleave(heads // k.shape[1], dim=1)
    v = v.repeat_interleave(heads // v.shape[1], dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * softmax_scale
    i = torch.arange(q_len)[:, None] + k_len - q_len
    j = torch.arange(k_len)[None, :]
    if alibi_slopes is not None:
        scores = scores - alibi_slopes[:, None, None] * (i - j).abs()
    hidden = j > i
    if window_size[0] >= 0:
        hidden |= i - j > window_size[0]
    scores = scores.masked_fill(hidden, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def _fake_flash_functions():
    def dense(q, k, v, **options):
        return torch.stack([_flash_reference(q[b], k[b], v[b], **options) for b in range(len(q))])

    def varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **options):
        # Sequence i: queries q[cu_q[i]:cu_q[i + 1]], keys k[cu_k[i]:cu_k[i + 1]], bottom-right
        # aligned (possibly no queries).
        assert cu_seqlens_q.dtype == cu_seqlens_k.dtype == torch.int32
        q_bounds, k_bounds = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        assert len(q_bounds) == len(k_bounds) and q_bounds[-1] == len(q)
        assert max_seqlen_q == max(b - a for a, b in zip(q_bounds, q_bounds[1:], strict=False))
        assert max_seqlen_k == max(b - a for a, b in zip(k_bounds, k_bounds[1:], strict=False))
        parts = [
            _flash_reference(q[qa:qb], k[ka:kb], v[ka:kb], **options)
            for qa, qb, ka, kb in zip(q_bounds, q_bounds[1:], k_bounds, k_bounds[1:], strict=False)
        ]
        return torch.cat(parts)

    return dense, varlen


@pytest.fixture
def flash_on_cpu(monkeypatch):
    monkeypatch.setattr(flash, "flash_functions", _fake_flash_functions)
    monkeypatch.setattr(flash, "check_inputs", lambda q: None)


def test_varlen_layout_of_documents_and_padding():
    sid = torch.tensor([[0, 0, 1, 1, 1, -1], [4, 4, 4, 4, 7, 7]])
    layout = flash.varlen_layout(sid)
    assert layout.k_indices.tolist() == layout.q_indices.tolist() == [0, 1, 2, 3, 4, 6, 7, 8, 9,
                                                                     10, 11]  # fmt: skip
    assert layout.cu_seqlens_k.tolist() == layout.cu_seqlens_q.tolist() == [0, 2, 5, 9, 11]
    assert layout.cu_seqlens_q.dtype == torch.int32
    assert layout.max_seqlen_q == layout.max_seqlen_k == 4
    # A document id repeated across rows is still two documents.
    layout = flash.varlen_layout(torch.zeros(2, 3, dtype=torch.long))
    assert layout.cu_seqlens_k.tolist() == [0, 3, 6]


def test_varlen_layout_of_queries_after_a_cache():
    """Two new queries per row over five keys: left padding (a document of its own, or -1)
    gets no queries; a row whose queries straddle two documents splits them."""
    sid = torch.tensor([[0, 0, 1, 1, 1], [-1, 1, 1, 1, 1], [1, 1, 1, 2, 2], [3, 3, 3, 3, 4]])
    layout = flash.varlen_layout(sid, q_len=2)
    assert layout.k_indices.tolist() == [0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15,
                                         16, 17, 18, 19]  # fmt: skip
    assert layout.cu_seqlens_k.tolist() == [0, 2, 5, 9, 12, 14, 18, 19]
    assert layout.cu_seqlens_q.tolist() == [0, 0, 2, 4, 4, 6, 7, 8]
    assert layout.q_indices.tolist() == [0, 1, 2, 3, 4, 5, 6, 7]
    assert (layout.max_seqlen_q, layout.max_seqlen_k) == (2, 4)


@pytest.mark.parametrize("alibi", [True, False])
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
@pytest.mark.parametrize("documents", ["none", "packed", "padded"])
def test_flash_glue_equals_dense_reference(flash_on_cpu, alibi, window, kv_heads, documents):
    q, k, v = (t.requires_grad_() for t in _qkv(kv_heads=kv_heads))
    sid = (
        None if documents == "none" else _sequence_id(3, 40, pad=4 if documents == "padded" else 0)
    )
    masks = AttentionMasks(4, 40, alibi=ALiBi(8) if alibi else None, window=window)
    ref = torch_attention(q, k, v, masks(sid, q.device, q.dtype), 0.0, 0.3).transpose(1, 2)
    out = flash.flash_attention(q, k, v, masks(sid, q.device, q.dtype), 0.0, 0.3).transpose(1, 2)
    keep = torch.ones(3, 40, dtype=torch.bool) if sid is None else sid >= 0
    torch.testing.assert_close(out[keep], ref[keep], atol=1e-5, rtol=0)
    if documents == "padded":
        assert (out[~keep] == 0).all()
    weights = torch.randn_like(ref[keep])
    grads = torch.autograd.grad((out[keep] * weights).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref[keep] * weights).sum(), (q, k, v))
    for name, g, r in zip("qkv", grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=0, msg=name)


def test_flash_glue_decoding_step_is_bottom_right_aligned(flash_on_cpu):
    q, k, v = _qkv(q_len=3)
    masks = AttentionMasks(4, 40, alibi=ALiBi(8))
    ref = torch_attention(q, k, v, masks(None, q.device, q.dtype), 0.0, 0.3)
    out = flash.flash_attention(q, k, v, masks(None, q.device, q.dtype), 0.0, 0.3)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("q_len", [1, 3])
@pytest.mark.parametrize("kv_heads", [4, 1])
@pytest.mark.parametrize("alibi", [True, False])
@pytest.mark.parametrize("window", [None, 7])
def test_flash_glue_decodes_documents_and_padding_after_a_cache(
    flash_on_cpu, q_len, kv_heads, alibi, window
):
    """Decoding left-padded prompts or rows that joined a running batch: the last `q_len`
    queries over every cached key with documents equal the reference (flash-attn's varlen
    form with separate query and key layouts)."""
    q, k, v = (t.requires_grad_() for t in _qkv(kv_heads=kv_heads, q_len=q_len))
    sid = _sequence_id(3, 40)
    sid[0, :6] = -1  # left padding dropped before the kernel
    sid[1, -1] = 4  # the last query is a document of one token
    sid[2, -2:] = 3  # three queries straddle two documents
    masks = AttentionMasks(4, 40, alibi=ALiBi(8) if alibi else None, window=window)
    ref = torch_attention(q, k, v, masks(sid, q.device, q.dtype), 0.0, 0.3)
    out = flash.flash_attention(q, k, v, masks(sid, q.device, q.dtype), 0.0, 0.3)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    weights = torch.randn_like(ref)
    grads = torch.autograd.grad((out * weights).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref * weights).sum(), (q, k, v))
    for name, g, r in zip("qkv", grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=0, msg=name)


def test_flash_generates_padded_batches_and_joins_as_torch(flash_on_cpu, monkeypatch):
    """Batched `generate` over left-padded prompts and a prompt joining a running batch (the
    server's continuous batching) give the tokens of attn_impl=torch with the same weights."""
    monkeypatch.setattr(flash, "missing_package", lambda: None)
    prompts = [[1, 2, 3, 4, 5, 6, 7], [8, 9, 10], [42]]
    greedy = GenerationConfig(max_new_tokens=8, temperature=0)
    outputs = []
    for impl in ("torch", "flash"):
        torch.manual_seed(0)
        config = MPTConfig(d_model=32, n_heads=4, n_layers=2, max_seq_len=64, vocab_size=50,
                           kv_n_heads=2, sliding_window=6, attn_impl=impl)  # fmt: skip
        model = MPTForCausalLM(config).eval()
        batch = generate(model, *left_pad(prompts[:2]), greedy).tokens
        decoder = Decoder(model, *left_pad(prompts[:2]), greedy)
        decoder.step()
        decoder.add(prompts[2], greedy)
        while not decoder.done:
            decoder.step()
        outputs.append((batch, decoder.output().tokens))
    assert outputs[1] == outputs[0]


def test_flash_layout_is_built_once_per_forward(flash_on_cpu, monkeypatch):
    calls = []
    real = flash.varlen_layout
    monkeypatch.setattr(flash, "varlen_layout", lambda *args: calls.append(1) or real(*args))
    q, k, v = _qkv()
    mask = AttentionMasks(4, 40, alibi=ALiBi(8))(_sequence_id(3, 40), "cpu", q.dtype)
    for _ in range(3):  # three layers
        flash.flash_attention(q, k, v, mask, 0.0, 0.3)
    assert len(calls) == 1


def test_flash_never_builds_the_dense_bias(flash_on_cpu, monkeypatch):
    """flash takes ALiBi as slopes and documents as cu_seqlens: the [1, H, L, L] bias that
    torch and sdpa cache must not be built (nor counted by the planner: DENSE_BIAS_IMPLS)."""
    builds = []
    monkeypatch.setattr(attention, "causal_alibi_bias", lambda *args: builds.append(args))
    monkeypatch.setattr(flash, "missing_package", lambda: None)
    _, model = _model_pair("flash", alibi=True)
    ids = torch.randint(0, 101, (3, 40))
    for sid in (None, _sequence_id(3, 40, pad=3)):
        model(ids, sid)
    assert builds == [] and "flash" not in DENSE_BIAS_IMPLS


def test_flash_without_package_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # makes find_spec report it missing
    with pytest.raises(
        ValueError, match=r"needs the flash_attn package.*pip install 'llmfoundry\[gpu\]'"
    ):
        MPTConfig(d_model=32, n_heads=4, n_layers=1, attn_impl="flash")
    with pytest.raises(ImportError, match=r"pip install 'llmfoundry\[gpu\]'"):
        flash.flash_functions()


def test_flash_on_cpu_says_it_needs_cuda():
    q, k, v = _qkv()
    mask = AttentionMasks(4, 40, alibi=ALiBi(8))(None, "cpu", q.dtype)
    with pytest.raises(UserError, match="attn_impl='flash' needs a CUDA device"):
        flash.flash_attention(q, k, v, mask, 0.0, 0.3)


# --- flex ------------------------------------------------------------------------------------


def _model_pair(impl, device="cpu", **overrides):
    base = dict(
        d_model=64,
        n_heads=4,
        n_layers=2,
        max_seq_len=48,
        vocab_size=101,
        kv_n_heads=2,
        qk_ln=True,
        sliding_window=24,
    )
    base.update(overrides)
    torch.manual_seed(0)
    ref = MPTForCausalLM(MPTConfig(attn_impl="torch", **base)).to(device)
    other = MPTForCausalLM(MPTConfig(attn_impl=impl, **base)).to(device)
    other.load_state_dict(ref.state_dict())
    return ref, other


@pytest.mark.slow  # compiles FlexAttention for CPU (~40 s)
def test_flex_forward_on_cpu_equals_torch():
    ref, fast = _model_pair("flex")
    torch.manual_seed(1)
    ids = torch.randint(0, 101, (3, 40))
    with torch.no_grad():
        for sid in (_sequence_id(3, 40, pad=3), _sequence_id(3, 40)):  # no recompile between
            torch.testing.assert_close(fast(ids, sid), ref(ids, sid), rtol=0, atol=1e-5)


@pytest.mark.slow  # compiles FlexAttention for CPU
@pytest.mark.parametrize("q_len", [3, 40])
def test_flex_on_cpu_pads_to_whole_blocks_and_equals_torch(q_len):
    # torch's compiled CPU kernel returns garbage rows for lengths that are not whole 128-token
    # blocks on some CPUs; flex.py pads. Decoding steps (q_len < k_len) stay bottom-right aligned.
    q, k, v = _qkv(batch=4, kv_heads=2, q_len=q_len)
    sid = _sequence_id(4, 40, pad=3)
    masks = AttentionMasks(4, 40, alibi=ALiBi(8), window=24)
    with torch.no_grad():
        ref = torch_attention(q, k, v, masks(sid, q.device, q.dtype), 0.0, 0.3)
        out = flex_attention(q, k, v, masks(sid, q.device, q.dtype), 0.0, 0.3)
    assert out.shape == ref.shape
    keep = (sid >= 0)[:, -q_len:]
    torch.testing.assert_close(
        out.transpose(1, 2)[keep], ref.transpose(1, 2)[keep], atol=1e-5, rtol=0
    )


def _unique_graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


@pytest.mark.slow  # compiles FlexAttention for CPU (~1 min)
def test_compiled_blocks_with_flex_compile_once_more_for_other_lengths_and_equal_torch():
    """model.compile=true with attn_impl=flex: the BlockMask is built in the model's forward,
    outside the compiled blocks (built inside, inductor's CPU lowering refused it; looked up
    there by length, every new length recompiled the blocks until torch.compile's limit of 8
    sent them back to eager). A second length compiles once more, with dynamic shapes; a third
    compiles nothing."""
    ref, fast = _model_pair("flex", max_seq_len=384, compile=True)
    fast = SingleDevice("cpu").prepare(fast)  # compiles every block
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(1)
    graphs = []
    with torch.no_grad():
        for seq_len in (128, 256, 384):
            ids = torch.randint(0, 101, (2, seq_len))
            torch.testing.assert_close(fast(ids), ref(ids), rtol=0, atol=1e-5)
            graphs.append(_unique_graphs())
    assert graphs == [1, 2, 2]
    assert fast.transformer.masks.cached is None  # flex never built the dense bias


def test_flex_training_on_cpu_is_refused_clearly():
    _, fast = _model_pair("flex")
    with pytest.raises(UserError, match="cannot train on CPU.*attn_impl=sdpa"):
        fast(torch.randint(0, 101, (1, 8)))


def test_flex_has_no_attention_dropout():
    with pytest.raises(ValueError, match="attn_impl='flex' has no attention dropout"):
        MPTConfig(d_model=32, n_heads=4, n_layers=1, attn_impl="flex", attn_pdrop=0.1)


# --- on a GPU ----------------------------------------------------------------------------------


def _relative_error(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-12))


@pytest.mark.cuda  # the flex and flash kernels' training paths need CUDA
@pytest.mark.parametrize("impl", ["flex", "flash"])
@pytest.mark.parametrize("documents", [False, True])
def test_gpu_kernel_forward_and_gradients_match_torch(impl, documents):
    if impl == "flash" and flash.missing_package():
        pytest.skip(flash.missing_package())
    ref, fast = _model_pair(impl, device="cuda", max_seq_len=256)
    torch.manual_seed(1)
    ids = torch.randint(0, 101, (4, 256), device="cuda")
    sid = _sequence_id(4, 256, pad=5).cuda() if documents else None
    keep = torch.ones(4, 256, dtype=torch.bool, device="cuda") if sid is None else sid >= 0
    labels = ids.masked_fill(~keep, -100)
    outs = []
    for model in (ref, fast):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(ids, sid)
        MPTForCausalLM.loss(logits, labels).backward()
        outs.append(logits[keep])
    assert _relative_error(outs[1], outs[0]) < 2e-2
    for (name, p_ref), p_fast in zip(ref.named_parameters(), fast.parameters(), strict=True):
        assert _relative_error(p_fast.grad, p_ref.grad) < 2e-2, name


@pytest.mark.cuda  # FlexAttention's backward needs CUDA
@pytest.mark.slow  # compiles the blocks at several lengths
@pytest.mark.parametrize("qk_ln", [False, True])
def test_gpu_compiled_blocks_with_flex_train_at_several_lengths(qk_ln):
    """model.compile=true, attn_impl=flex, bf16 training steps at three lengths, then with
    documents at two: losses and gradients within bf16 error of the eager torch reference; the
    blocks compile again for the second length (dynamic shapes) but not the third, and
    documents compile once and once more at their second length: [1, 2, 2, 3, 4] graphs on the
    H200 (torch 2.11, bench/RESULTS.md). Before: a recompile per length, eager after 8."""
    ref, fast = _model_pair("flex", device="cuda", max_seq_len=512, compile=True, qk_ln=qk_ln)
    fast = SingleDevice("cuda").prepare(fast)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(1)
    graphs = []
    for seq_len, documents in ((256, False), (512, False), (384, False), (384, True), (512, True)):
        ids = torch.randint(0, 101, (4, seq_len), device="cuda")
        sid = _sequence_id(4, seq_len, pad=5).cuda() if documents else None
        losses = []
        for model in (ref, fast):
            model.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(ids, sid)
            loss = MPTForCausalLM.loss(
                logits, ids if sid is None else ids.masked_fill(sid < 0, -100)
            )
            loss.backward()
            losses.append(loss.detach())
        assert _relative_error(losses[1], losses[0]) < 2e-2, seq_len
        for (name, p_ref), p_fast in zip(ref.named_parameters(), fast.parameters(), strict=True):
            assert _relative_error(p_fast.grad, p_ref.grad) < 2e-2, (seq_len, name)
        graphs.append(_unique_graphs())
    assert graphs[2] == graphs[1] and graphs[-1] <= 4, graphs


def test_scale_default_is_inverse_sqrt_head_dim():
    model = MPTForCausalLM(MPTConfig(d_model=64, n_heads=4, n_layers=1, vocab_size=10))
    assert model.transformer.blocks[0].attn.softmax_scale == pytest.approx(1 / math.sqrt(16))


def test_flash_glue_as_infini_local_attention(flash_on_cpu):
    # Segments folded into the batch, the short last one padded with sequence id -1.
    q, k, v = _qkv(seq=22)
    sid = _sequence_id(3, 22)
    gate = torch.tensor([0.5, -1.0, 2.0, 0.0])
    outs = []
    for local in (torch_attention, flash.flash_attention):
        mask = AttentionMasks(4, 8, alibi=ALiBi(8))(sid, q.device, q.dtype)
        outs.append(
            infini_attention(
                q,
                k,
                v,
                mask,
                gate,
                8,
                "delta",
                1e-6,
                None,
                local=lambda q_, k_, v_, m, fn=local: fn(q_, k_, v_, m, 0.0, 0.3),
            )
        )
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=0)

"""Which SDPA backend each mask case gets (`attention.sdpa_plan`), that the plan computes the
same attention as the reference, and, on a GPU, that the planned backend is the one that ran."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from llmfoundry.distributed.parallelize import apply_compile
from llmfoundry.models import MPTConfig, MPTForCausalLM
from llmfoundry.models.generation import new_cache
from llmfoundry.models.layers import attention
from llmfoundry.models.layers.attention import (
    AttentionMasks,
    SdpaPlan,
    sdpa_attention,
    sdpa_plan,
    torch_attention,
)
from llmfoundry.models.layers.kernels import record_kernels
from llmfoundry.models.layers.position import ALiBi
from llmfoundry.models.llama import LlamaConfig, LlamaForCausalLM

H100 = (9, 0)
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def _sequence_id(batch, seq_len):
    """Three documents per row, with different boundaries in each row."""
    sid = torch.zeros(batch, seq_len, dtype=torch.long)
    for row in range(batch):
        sid[row, 5 + 3 * row :] = 1
        sid[row, 20 + row :] = 2
    return sid


def _mask(alibi=False, window=None, documents=False, seq=64, dtype=FP32, device="cpu"):
    masks = AttentionMasks(8, seq, ALiBi(8) if alibi else None, window)
    sid = _sequence_id(2, seq).to(device) if documents else None
    return masks(sid, torch.device(device), dtype)


# name: (mask options, q_len, kv_heads, dtype, head_dim, capability, expected plan on CUDA)
CASES = {
    "causal": ({}, 64, 8, BF16, 64, H100, SdpaPlan("flash", False, True)),
    "causal, grouped kv (Llama)": ({}, 64, 2, BF16, 128, H100, SdpaPlan("flash", False, True)),
    "decoding step": ({}, 1, 2, BF16, 64, H100, SdpaPlan("flash", False, False)),
    "queries after a cache": ({}, 7, 2, BF16, 64, H100, SdpaPlan("efficient", True, False, True)),
    "documents": ({"documents": True}, 64, 8, BF16, 64, H100, SdpaPlan("efficient", True, False)),
    "documents, grouped kv": (
        {"documents": True},
        64,
        2,
        BF16,
        64,
        H100,
        SdpaPlan("efficient", True, False, True),
    ),
    "alibi (MPT)": ({"alibi": True}, 64, 8, BF16, 64, H100, SdpaPlan("efficient", True, False)),
    "alibi, grouped kv": (
        {"alibi": True},
        64,
        2,
        BF16,
        64,
        H100,
        SdpaPlan("efficient", True, False, True),
    ),
    "window": ({"window": 16}, 64, 2, BF16, 64, H100, SdpaPlan("efficient", True, False, True)),
    "fp32 causal": ({}, 64, 2, FP32, 64, H100, SdpaPlan("efficient", False, True, True)),
    "head_dim 320": ({}, 64, 8, BF16, 320, H100, SdpaPlan("efficient", False, True)),
    "head_dim 4, bias": ({"documents": True}, 64, 8, BF16, 4, H100, SdpaPlan("math", True, False)),
    "sm86, head_dim 256": ({}, 64, 8, BF16, 256, (8, 6), SdpaPlan("efficient", False, True)),
    "sm75 fp16": ({}, 64, 2, FP16, 64, (7, 5), SdpaPlan("efficient", False, True, True)),
    "sm75 bf16": ({}, 64, 2, BF16, 64, (7, 5), SdpaPlan("math", False, True)),
}


@pytest.mark.parametrize("case", CASES)
def test_each_mask_case_gets_the_best_backend_it_permits(case):
    options, q_len, kv_heads, dtype, head_dim, capability, expected = CASES[case]
    mask = _mask(**options)
    plan = sdpa_plan(mask, (2, 8, q_len, head_dim), (2, kv_heads, 64, head_dim), dtype,
                     capability=capability)  # fmt: skip
    assert plan == expected


def test_on_cpu_the_flash_kernel_takes_any_mask_but_no_dropout():
    mask = _mask(alibi=True, documents=True)
    shapes = ((2, 8, 64, 16), (2, 2, 64, 16))
    assert sdpa_plan(mask, *shapes, FP32, device_type="cpu") == SdpaPlan("flash", True, False)
    assert sdpa_plan(mask, *shapes, FP32, 0.1, device_type="cpu").kernel == "math"


@pytest.mark.parametrize("plan_dtype", [BF16, FP32])
@pytest.mark.parametrize("q_len", [40, 7, 1])
@pytest.mark.parametrize(
    "options",
    [{}, {"documents": True}, {"alibi": True}, {"window": 9}, {"alibi": True, "documents": True}],
)
def test_the_cuda_plans_compute_the_reference_attention(monkeypatch, plan_dtype, q_len, options):
    """Each CUDA plan (no mask, is_causal, or the bias; key/value heads expanded or not) run
    on CPU against the written-out reference, decoding steps included."""

    def cuda_plan(q, k, mask, dropout_p):
        return sdpa_plan(mask, q.shape, k.shape, plan_dtype, dropout_p, "cuda", H100)

    monkeypatch.setattr(attention, "plan_for", cuda_plan)
    torch.manual_seed(0)
    q = torch.randn(2, 8, q_len, 16, requires_grad=True)
    k, v = (torch.randn(2, 2, 40, 16, requires_grad=True) for _ in range(2))
    out = sdpa_attention(q, k, v, _mask(seq=40, **options), 0.0, 0.3)
    ref = torch_attention(q, k, v, _mask(seq=40, **options), 0.0, 0.3)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    for grad, ref_grad in zip(grads, torch.autograd.grad(ref.sum(), (q, k, v)), strict=True):
        torch.testing.assert_close(grad, ref_grad, atol=1e-5, rtol=0)


def test_a_compiled_block_plans_with_the_device_s_capability(monkeypatch):
    """Inside torch.compile the plan reads the capability as a constant and compares it. With
    the (major, minor) tuple an assume_constant_result function returned, torch 2.11's dynamo
    failed there (InternalTorchDynamoError), which broke every compiled block on sdpa on the
    H200; the capability now crosses as one int."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 6))
    cuda = torch.device("cuda")
    mask = _mask(seq=40, alibi=True)

    @torch.compile(backend="eager", fullgraph=True)
    def plan(q):
        capability = attention.device_capability(cuda)
        chosen = sdpa_plan(mask, q.shape, (2, 2, 40, 16), BF16, 0.0, "cuda", capability)
        return q + (1 if chosen.kernel == "efficient" else 0), capability

    torch._dynamo.reset()
    out, capability = plan(torch.zeros(2, 8, 40, 16))
    assert capability == (8, 6) and bool((out == 1).all())
    assert attention.device_capability(torch.device("cpu")) == (0, 0)


def test_the_bias_rows_are_aligned_for_the_efficient_kernel():
    """SDPA's efficient kernel needs a bias whose strides are multiples of 8 elements, or
    torch copies it into an aligned buffer in every layer."""
    mask = _mask(alibi=True, documents=True, seq=37)
    for q_len in (37, 1):
        bias = mask.dense_bias(q_len, 37)
        assert all(stride % 8 == 0 for stride in bias.stride()[:-1]), bias.stride()
    assert mask.source.causal_bias(37, torch.device("cpu"), FP32).stride()[-2] == 40


class _AttentionOps(TorchDispatchMode):
    """The fused attention ops that ran (their forward and backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.ran: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if "_scaled_dot_product" in func.__name__:
            self.ran.append(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))


def _models(device="cpu", **overrides):
    base = dict(d_model=64, n_heads=4, n_layers=1, max_seq_len=64, vocab_size=101)
    torch.manual_seed(0)
    mpt = MPTForCausalLM(MPTConfig(**base, kv_n_heads=2, **overrides))
    llama = LlamaForCausalLM(LlamaConfig(**base, n_kv_heads=2, ffn_hidden_size=128, **overrides))
    return {"mpt": mpt.to(device), "llama": llama.to(device)}


def test_the_kernel_that_ran_is_recorded_per_model_and_batch():
    """`record_kernels` names what each attention call runs: on CPU, sdpa's flash kernel (the
    op that ran says so) for MPT's ALiBi and for Llama's documents alike."""
    ids, sid = torch.randint(0, 101, (2, 64)), _sequence_id(2, 64)
    for name, model in _models().items():
        for rows in (None, sid):
            with record_kernels(model) as ran, _AttentionOps() as ops:
                model(ids, rows)
            assert ran == ["sdpa:flash"], name
            assert ops.ran == ["_scaled_dot_product_flash_attention_for_cpu"], name
        assert model.transformer.blocks[0].attn.attn_fn is sdpa_attention  # restored


def test_plain_decoding_builds_no_bias():
    """Llama's prompt (is_causal) and its decoding steps (one query sees every key) need no
    bias: none is built, so both can run SDPA's flash kernel on CUDA."""
    model = _models()["llama"]
    ids = torch.randint(0, 101, (2, 9))
    cache = new_cache(model, 16)
    with record_kernels(model) as ran:
        model(ids[:, :8], cache=cache)
        model(ids[:, 8:], cache=cache)
    assert model.transformer.masks.cached is None
    plans = [attention.sdpa_plan(_mask(seq=9), (2, 4, q, 16), (2, 2, 9, 16), BF16) for q in (9, 1)]
    assert [plan.kernel for plan in plans] == ["flash", "flash"] and ran == ["sdpa:flash"] * 2


# --- on a GPU ----------------------------------------------------------------------------------

_OPS = {
    "flash": "_scaled_dot_product_flash_attention",
    "efficient": "_scaled_dot_product_efficient_attention",
}


@pytest.mark.cuda  # SDPA's fused CUDA backends need a GPU
@pytest.mark.parametrize("case", [c for c, spec in CASES.items() if spec[5] == H100])
def test_gpu_runs_the_planned_backend_alone(case):
    """With only the planned backend allowed (sdpa_attention's sdpa_kernel), each case runs,
    forward and backward, the fused op the plan names (none for math), within bf16 error of
    the fp32 reference. The table's H100 cases, on any sm80+ GPU."""
    options, q_len, kv_heads, dtype, head_dim, _, expected = CASES[case]
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("the table's plans are for sm80 and newer")
    torch.manual_seed(0)
    q = torch.randn(2, 8, q_len, head_dim, device="cuda", requires_grad=True)
    k, v = (torch.randn(2, kv_heads, 64, head_dim, device="cuda", requires_grad=True)
            for _ in range(2))  # fmt: skip
    low = [t.to(dtype) for t in (q, k, v)]
    with _AttentionOps() as ops:
        out = sdpa_attention(*low, _mask(**options, dtype=dtype, device="cuda"), 0.0, 0.125)
        out.float().sum().backward()
    ref = torch_attention(q, k, v, _mask(**options, device="cuda"), 0.0, 0.125)
    error = (out.float() - ref).norm() / ref.norm()
    assert error < (2e-2 if dtype != FP32 else 5e-3), error  # fp32: TF32 tensor cores
    fused = [] if expected.kernel == "math" else [_OPS[expected.kernel]]  # math: plain ops
    assert ops.ran == fused + [f"{op}_backward" for op in fused], ops.ran


@pytest.mark.cuda  # SDPA's fused CUDA backends need a GPU
@pytest.mark.parametrize("documents", [False, True])
def test_gpu_models_run_the_recorded_kernel(documents):
    """MPT (ALiBi: always a bias) and Llama (grouped kv) in bf16: the kernel `record_kernels`
    names is the fused op that ran: flash for Llama's plain causal batches, efficient
    otherwise."""
    ids = torch.randint(0, 101, (2, 64), device="cuda")
    sid = _sequence_id(2, 64).cuda() if documents else None
    expected = {"mpt": "efficient", "llama": "efficient" if documents else "flash"}
    for name, model in _models("cuda").items():
        with record_kernels(model) as ran, _AttentionOps() as ops:
            with torch.autocast("cuda", dtype=BF16):
                logits = model(ids, sid)
            logits.float().sum().backward()
        assert ran == [f"sdpa:{expected[name]}"], name
        assert ops.ran == [_OPS[expected[name]], _OPS[expected[name]] + "_backward"], name


@pytest.mark.cuda  # SDPA's fused CUDA backends need a GPU
@pytest.mark.slow  # compiles the blocks
def test_gpu_compiled_blocks_run_the_planned_backend():
    """Compiled blocks (model.compile=true's `apply_compile`): the plan and its sdpa_kernel
    hold inside the compiled graph; the profiler names the fused op it calls."""
    for name, model in _models("cuda").items():
        apply_compile(list(model.transformer.blocks))
        for seq_len, documents in ((64, False), (48, True), (56, True)):
            ids = torch.randint(0, 101, (2, seq_len), device="cuda")
            sid = _sequence_id(2, seq_len).cuda() if documents else None
            kernel = "flash" if name == "llama" and not documents else "efficient"
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                with torch.autocast("cuda", dtype=BF16):
                    logits = model(ids, sid)
                logits.float().sum().backward()
            ran = {e.key for e in prof.key_averages() if "_scaled_dot_product_" in e.key}
            op = f"aten::{_OPS[kernel]}"
            assert ran == {op, f"{op}_backward"}, (name, seq_len, ran)

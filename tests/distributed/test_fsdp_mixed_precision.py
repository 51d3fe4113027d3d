"""FSDP2 with bf16 mixed precision hands each unit its arguments as the model made them, in one
process (gloo, world size 1: the casts are per unit, not per rank). FSDP2's `cast_forward_inputs`
rebuilds every dataclass among a unit's arguments to cast the float tensors in it, so it would
give each block its own AttentionMask (the attention bias built once per block instead of once
per forward), hand Llama's blocks their float32 RoPE rotations in bf16, and let a generation's
forward extend a copy of the caller's KVCache.

The numerics are otherwise those of before: MPT's losses and gradients are bit for bit the same
(nothing it passes its blocks was cast), and Llama's differ within bf16 rounding, its rotations
now float32 as without FSDP (measured on 4-layer models, 4 x 256 tokens: the gradient's relative
error against fp32 is 7.565e-3 with float32 rotations, 7.597e-3 with bf16 ones). The two-rank
bf16 run against fp32 is test_fsdp.py's."""

import pytest
import torch

import llmfoundry.models.layers.decoder as decoder_module
from llmfoundry.distributed.fsdp import FSDP
from llmfoundry.models.families import build_model
from llmfoundry.models.layers.attention import AttentionMask
from llmfoundry.models.layers.kv_cache import KVCache
from llmfoundry.models.mpt import MPTConfig, MPTForCausalLM
from tests.models.test_llama import tiny as tiny_llama

from .spawn import free_port

N_LAYERS = 4


@pytest.fixture(params=[None, "bf16"])
def fsdp(request, monkeypatch):
    """An FSDP strategy over this process alone, with and without bf16 mixed precision."""
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    strategy = FSDP("cpu", timeout_s=60, mixed_precision=request.param)
    strategy.setup()
    yield strategy
    strategy.teardown()


def mpt_with_alibi_and_documents() -> MPTForCausalLM:
    config = MPTConfig(
        d_model=32, n_heads=2, n_layers=N_LAYERS, max_seq_len=16, vocab_size=64, alibi=True
    )
    return MPTForCausalLM(config)


def test_the_attention_bias_is_built_once_per_forward(fsdp, monkeypatch):
    """ALiBi with packed documents: the dense bias (a [batch, heads, L, L] tensor) is built by
    the first block and shared by the others, as without FSDP."""
    builds = []
    build = AttentionMask._dense
    monkeypatch.setattr(
        AttentionMask, "_dense", lambda mask, *a: builds.append(1) or build(mask, *a)
    )
    model = fsdp.prepare(mpt_with_alibi_and_documents())
    ids = torch.randint(0, 64, (2, 16))
    documents = (torch.arange(16) >= 7).long().expand(2, 16)
    with torch.no_grad():
        logits = model({"input_ids": ids, "labels": ids, "sequence_id": documents})
    assert logits.dtype == (torch.float32 if fsdp.mixed_precision is None else torch.bfloat16)
    assert len(builds) == 1


def test_rope_rotations_reach_the_blocks_in_float32(fsdp, monkeypatch):
    seen = []
    rotate = decoder_module.apply_rope
    monkeypatch.setattr(
        decoder_module,
        "apply_rope",
        lambda x, cos, sin: seen.append(cos.dtype) or rotate(x, cos, sin),
    )
    model = fsdp.prepare(build_model(tiny_llama(n_layers=N_LAYERS), init_device="meta"))
    with torch.no_grad():
        model(torch.randint(0, 64, (2, 16)))
    assert len(seen) == 2 * N_LAYERS and set(seen) == {torch.float32}


def test_decoding_with_a_kv_cache_extends_the_callers_cache(fsdp):
    """Llama's positions come from the cache's length: a forward that extended a copy of the
    cache would leave the caller's at 0, and the next step would rotate its keys as if it
    started the sequence."""
    model = fsdp.prepare(build_model(tiny_llama(), init_device="meta"))
    ids = torch.randint(0, 64, (2, 12))
    cache = KVCache.for_model(model, 16)
    with torch.no_grad():
        model(ids[:, :8], cache=cache)
        assert cache.length == 8
        step = model(ids[:, 8:], cache=cache)
        whole = model(ids)
    assert cache.length == 12
    torch.testing.assert_close(step.float(), whole[:, 8:].float(), rtol=0.02, atol=0.02)

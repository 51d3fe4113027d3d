"""The planner on a mixture of experts: experts sharded over ep x the experts' FSDP ranks, MoE
activations of top_k token copies, the all-to-all volume, the refusals of ep, and `--recommend`
searching ep. Every number below is computed by hand from the counts."""

import dataclasses
import re

import pytest
import torch

from llmfoundry.models.families import family_of
from llmfoundry.models.layers import moe
from llmfoundry.models.layers.moe import MoE, MoESpec
from llmfoundry.models.llama import LlamaConfig
from llmfoundry.models.mixtral import MixtralConfig
from llmfoundry.models.qwen3_moe import Qwen3MoeConfig
from llmfoundry.planning import (
    ModelCounts,
    Setup,
    count_model,
    moe_activation_bytes,
    plan_communication,
    plan_memory,
    recommend,
)
from tests.planning.test_mesh_planning import COUNTS

# The mesh test's toy (8 blocks of 1000 parameters, a 200-parameter tied embedding, a
# 10-parameter final norm, d_model 16, vocab 50), its blocks now MoE blocks: 800 of each
# block's 1000 parameters are 4 routed experts, each token goes to 2 of them, and the MoE
# layer keeps 100 bytes per token (on top of the block's 38 d).
MOE = dataclasses.replace(
    COUNTS,
    active_params=8210 - 8 * 400,
    experts=(800,) * 8,
    n_experts=4,
    top_k=2,
    moe_activation_bytes=100,
)


def moe_mesh(**kwargs) -> Setup:
    """fsdp over 8 devices, 8 sequences of 4 tokens per step (one microbatch of 1 each)."""
    options = {"strategy": "fsdp", "world_size": 8, "global_batch": 8}
    return Setup(None, 4, "amp_bf16", **{"counts": MOE, **options, **kwargs})


def test_experts_are_sharded_over_ep_times_their_fsdp_ranks():
    """Each expert is held by one ep rank and FSDP-sharded over the dp_shard / ep others: its
    weights, gradients and Adam state are 1/8 per device at any ep, as the rest; what ep shrinks
    is the gathered working copy, 2 x (200 + 800 / ep) parameters of a block."""
    plans = {ep: plan_memory(moe_mesh(ep=ep), 1) for ep in (1, 2, 4)}
    for ep, plan in plans.items():
        assert (plan.params, plan.grads, plan.optimizer) == (8210 / 2, 8210 / 2, 8210)
        assert plan.working == 2 * (200 + 800 / ep) * 4
        assert (plan.n_params, plan.active_params) == (8210, 5010)
    # Activations: per block and token 38 * 16 = 608 bytes plus the MoE layer's 100, 4 tokens,
    # 8 blocks; the embedding output (4 * 16 * 4) and the head's input ((4 + 2) * 16 * 4).
    assert plans[1].activations == 8 * (608 + 100) * 4 + 4 * 16 * 4 + 6 * 16 * 4
    # Under tp 2 the dense part of a block is split (experts are replicated over tp), and the
    # MoE layer's activations are whole: each tp rank routes the gathered sequence.
    tp = plan_memory(moe_mesh(tp=2, ep=2), 1)
    assert tp.params == (8 * 200 / 2 + 8 * 800 + 210 / 2) * 4 / 4
    assert tp.working == 2 * (200 / 2 + 800 / 2) * 4
    per_block = 608 * 4 / 2 + 2 * 2 * 16 * 4 * (1 - 1 / 2) + 100 * 4
    assert tp.activations == 8 * per_block + 4 * 16 * 4 / 2 + 6 * 16 * 4 / 2
    # With activation checkpointing: each block's float32 input, and one MoE block in full.
    checkpointed = plan_memory(moe_mesh(ep=2, activation_checkpointing=True), 1)
    assert checkpointed.activations == 8 * 4 * 16 * 4 + (608 + 100) * 4 + 4 * 16 * 4 + 6 * 16 * 4


def test_all_to_all_volume_and_the_experts_gathers():
    """Per MoE layer and microbatch, 4 tokens x top_k 2 = 8 copies of d_model 16 dispatched in
    the layer input's float32 (512 bytes each) and combined in the experts' bf16 (256), forward
    and backward, (ep - 1) / ep of it leaving the rank; FSDP gathers an expert only over its
    dp_shard / ep ranks."""
    for ep in (1, 2, 4):
        sent = plan_communication(moe_mesh(ep=ep), 1)
        assert sent.expert_parallel == 8 * 2 * (512 + 256) * (ep - 1) / ep
        dense, experts = (8 * 200 + 210) * 4, 8 * 800 * 4
        gathered = dense * 7 / 8 + experts / ep * (8 / ep - 1) / (8 / ep)
        assert sent.all_gather == 2 * gathered and sent.reduce_scatter == gathered
    # A recomputed forward dispatches and combines again; a low-precision input (a bf16 norm
    # output) halves it.
    checkpointed = plan_communication(moe_mesh(ep=4, activation_checkpointing=True), 1)
    assert checkpointed.expert_parallel == 8 * 3 * (512 + 256) * 3 / 4
    low = moe_mesh(ep=2, counts=dataclasses.replace(MOE, moe_input_bytes=2))
    assert plan_communication(low, 1).expert_parallel == 8 * 2 * 2 * 256 / 2
    # In float32 the outputs go back in float32 too.
    fp32 = dataclasses.replace(moe_mesh(ep=2), precision="fp32")
    assert plan_communication(fp32, 1).expert_parallel == 8 * 2 * (512 + 512) / 2
    # A dense model sends none.
    assert plan_communication(moe_mesh(counts=COUNTS), 1).expert_parallel == 0


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"ep": 3, "world_size": 9, "global_batch": 9}, "--ep=3 does not divide the model's 4 "
         "experts: choose an ep that divides the expert count"),
        ({"ep": 4, "tp": 2, "pp": 2}, "parallelism: ep=4 does not divide dp_shard=2 x cp=1 = 2: "
         "expert-parallel ranks are borrowed from those; choose an ep that divides it"),
        ({"ep": 2, "counts": COUNTS}, "--ep=2: this model has no experts to split (no "
         "mixture-of-experts layer); use an MoE model, or leave --ep out"),
        ({"ep": 2, "strategy": "ddp"}, "parallelism.ep=2: strategy=ddp runs the whole model on "
         "every process, without expert parallelism; use strategy=fsdp, or ep=1"),
    ],
)  # fmt: skip
def test_impossible_expert_parallel_meshes_are_refused(options, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        moe_mesh(**options)


def test_recommend_searches_ep():
    """With room for pure FSDP, the recommended mesh is the one that sends the fewest bytes: ep
    4's all-to-alls (9216 bytes) cost less than the experts' gathers they save (86205 bytes in
    all at ep 1, 53949 at ep 2, 37821 at ep 4)."""
    sent = {ep: plan_communication(moe_mesh(ep=ep), 1).total for ep in (1, 2, 4)}
    assert (sent[1], sent[2], sent[4]) == (86205, 53949, 37821)
    choice = recommend(moe_mesh(), 1e6)
    assert (choice.setup.tp, choice.setup.pp, choice.setup.ep) == (1, 1, 4)
    # A tight budget that only ep's smaller working copy fits: pure FSDP at ep 1 needs 2 x 1000
    # x 4 bytes of gathered block, ep 4 2 x 400 x 4.
    budget = plan_memory(moe_mesh(ep=4), 1).total
    assert plan_memory(moe_mesh(ep=2), 1).total > budget
    assert recommend(moe_mesh(), budget).setup.ep == 4
    # A dense model is never given an ep.
    assert recommend(moe_mesh(counts=COUNTS), 1e6).setup.ep == 1


def test_counts_default_to_a_dense_model():
    dense = ModelCounts(**{f.name: getattr(COUNTS, f.name) for f in dataclasses.fields(COUNTS)})
    assert dense.active_params == dense.n_params and dense.experts == (0,) * 8
    assert not dense.moe and MOE.moe


def saved_bytes(layer: torch.nn.Module, tokens: int, precision: str) -> int:
    """Bytes of the tensors autograd saves in one forward of `layer` on `tokens` float32 tokens
    (each storage once; the parameters and the input left out)."""
    x = torch.randn(1, tokens, layer.router.gate.in_features, requires_grad=True)
    left_out = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    left_out.add(x.untyped_storage().data_ptr())
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in left_out:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    layer(x)  # the first forward tries torch._grouped_mm once (grouped_mm_runs)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", torch.bfloat16, enabled=precision != "fp32"):
            layer(x)
    return sum(saved.values())


@pytest.mark.parametrize("grouped", [True, False])
@pytest.mark.parametrize("precision", ["fp32", "amp_bf16"])
def test_moe_activations_are_what_autograd_saves(precision, grouped, monkeypatch):
    """`moe_activation_bytes` against the tensors an MoE layer's forward saves for backward,
    per token: the growth from 256 to 512 tokens (what a layer saves once, its weights' bf16
    copies under autocast, cancels); with torch._grouped_mm and with the loop of matmuls (under
    autocast one more bf16 copy of each token copy: the plan is the grouped multiply's)."""
    if not grouped:
        monkeypatch.setattr(moe, "grouped_mm_runs", lambda device, dtype: False)
    torch.manual_seed(0)
    for shared, gate in ((0, False), (24, False), (24, True)):
        spec = MoESpec(n_experts=8, top_k=2, expert_hidden=48, shared_expert_hidden=shared,
                       shared_expert_gate=gate)  # fmt: skip
        layer = MoE(32, spec)
        measured = (saved_bytes(layer, 512, precision) - saved_bytes(layer, 256, precision)) / 256
        planned = moe_activation_bytes(spec, 32, precision)
        if grouped or precision == "fp32":
            assert measured == planned, (shared, gate)
        else:  # under autocast the loop's gate and up matmuls each cast the copy to bf16
            assert measured == planned + spec.top_k * 2 * 32, (shared, gate)


def test_an_moe_models_counts_are_read_from_it():
    """From a Mixtral built on the meta device: every block's routed experts (4 x 3 x 32 x 16),
    the active parameters and flops the model counts (its router, top 2 of 4 experts), the MoE
    layer's activations from its spec and the rest of a block's from the family."""
    config = MixtralConfig(d_model=32, n_heads=4, n_kv_heads=2, n_layers=2, n_experts=4, top_k=2,
                           expert_hidden=16, vocab_size=64, max_seq_len=16)  # fmt: skip
    counts = count_model(config, 16, "fp32")
    model = family_of(config).build(config, init_device="meta")
    assert counts.experts == (4 * 3 * 32 * 16,) * 2 and (counts.n_experts, counts.top_k) == (4, 2)
    assert counts.active_params == model.num_params(active=True) == counts.n_params - 2 * 3072
    assert counts.flops_per_token == model.flops_per_token(16)
    assert counts.moe_activation_bytes == moe_activation_bytes(
        config.decoder_spec().moe, 32, "fp32"
    )
    assert counts.block_activation_bytes == family_of(config).activation_bytes(config, "fp32")
    dense = count_model(LlamaConfig(d_model=32, n_heads=4, n_kv_heads=2, n_layers=2,
                                    vocab_size=64), 16, "fp32")  # fmt: skip
    assert not dense.moe and dense.moe_activation_bytes == 0


def test_recommended_meshes_for_qwen3_30b_a3b_and_mixtral_8x7b():
    """The README's recommendations (seq 4096, 512 sequences per step, bf16, activation
    checkpointing, 80 GB H100s): Qwen3-30B-A3B fits 8 GPUs only with ep, whose all-to-alls
    cost less than FSDP regathering all 30.5B weights for each of 32 microbatches of 2; on 64
    GPUs one microbatch each, and pure FSDP's one gather sends less than ep's all-to-alls.
    Mixtral-8x7B's 16 bytes x 46.7B do not fit 8 GPUs; on 64, ep 8."""

    def mesh(config, world):
        setup = Setup(config, 4096, "amp_bf16", strategy="fsdp", world_size=world,
                      activation_checkpointing=True, global_batch=512)  # fmt: skip
        choice = recommend(setup, 80e9)
        return choice and (choice.setup.tp, choice.setup.cp, choice.setup.pp, choice.setup.ep,
                           choice.microbatch)  # fmt: skip

    qwen = Qwen3MoeConfig.preset("qwen3-30b-a3b")
    mixtral = MixtralConfig.preset("mixtral-8x7b")
    assert mesh(qwen, 8) == (1, 1, 1, 8, 2)
    assert mesh(qwen, 64) == (1, 1, 1, 1, 8)
    assert mesh(mixtral, 8) is None
    assert mesh(mixtral, 64) == (1, 1, 1, 8, 8)

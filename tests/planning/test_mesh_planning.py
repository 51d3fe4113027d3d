"""The planner on a mesh (tp, pp): its formulas against hand-computed numbers, the refusals of
impossible meshes, and the recommended mesh of a case whose answer follows from arithmetic."""

import dataclasses
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from llmfoundry.distributed.parallelize import check_tensor_parallel
from llmfoundry.models import parallel_plan
from llmfoundry.models.families import family_of
from llmfoundry.models.layers import flash
from llmfoundry.models.llama import LlamaConfig
from llmfoundry.models.mpt import MPTConfig
from llmfoundry.planning import (
    ModelCounts,
    Setup,
    bubble_fraction,
    count_model,
    plan_communication,
    plan_memory,
    recommend,
    step_seconds,
)

ROOT = Path(__file__).resolve().parents[2]
# The parallel plan of an MPT of that shape (training's checks of a mesh read it).
PLAN = count_model(
    MPTConfig(d_model=16, n_heads=4, kv_n_heads=2, n_layers=8, vocab_size=50, max_seq_len=4),
    4,
    "amp_bf16",
).plan
# 8 blocks of 1000 parameters, a 200-parameter embedding tied to the head, a 10-parameter final
# norm; d_model 16, vocab 50, 4 query heads and 2 key/value heads; MPT's amp_bf16 activation
# count (38 d bytes per token per block). Every number below is computed from these by hand.
COUNTS = ModelCounts(
    n_params=8210,
    flops_per_token=6 * 8210,
    blocks=(1000,) * 8,
    first=200,
    last=10,
    tied=200,
    block_activation_bytes=38 * 16,
    d_model=16,
    vocab_size=50,
    n_heads=4,
    n_kv_heads=2,
    plan=PLAN,
)


def mesh(**kwargs) -> Setup:
    """fsdp over 16 devices at tp 2 x pp 2 (dp_shard 4), 16 sequences of 4 tokens per step."""
    options = {"strategy": "fsdp", "world_size": 16, "tp": 2, "pp": 2, "global_batch": 16}
    return Setup(None, 4, "amp_bf16", **{"counts": COUNTS, **options, **kwargs})


def test_memory_per_device_on_a_tp_x_pp_mesh():
    setup = mesh()
    assert (setup.dims.dp_shard, setup.dims.dp_replicate) == (4, 1)
    assert setup.stage_layers == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # Rank 0: (4 blocks + embedding) / tp = 2100 parameters, sharded 4 ways: 2100 bytes of
    # float32 weights, 2100 of gradients, 4200 of Adam; working: 2 gathered blocks / tp, float32.
    # Activations per block per microbatch of 4 tokens: 38 * 16 * 4 / tp = 1216, plus the two
    # gathered projection inputs 2 * 2 * 16 * 4 * (1 - 1/2) = 128: 1344. 1F1B keeps
    # min(m = 16 / 4 = 4, pp - 0 = 2) microbatches: 2 * 4 blocks * 1344 = 10752, and the
    # embedding output 4 * 16 * 4 / tp = 128 per microbatch.
    plan = plan_memory(setup, 1)
    assert plan.stage == 0
    assert (plan.params, plan.grads, plan.optimizer, plan.working) == (2100, 2100, 4200, 4000)
    assert (plan.activations, plan.logits) == (10752 + 256, 0)
    # Rank 1 (4 blocks, norm, the tied head's copy of the embedding: 2105 parameters) keeps one
    # microbatch: 4 * 1344 blocks, (4 + 2) * 16 * 4 / tp edges, 2 * 4 * 50 * 2 / tp logits.
    assert plan.total == 23408 > 2105 * 4 + 4000 + 4 * 1344 + 192 + 400
    # Checkpointed: each block's float32 input 4 * 16 * 4 / tp = 128 per block and microbatch
    # in flight, plus one block's full activations.
    assert plan_memory(mesh(activation_checkpointing=True), 1).activations == 8 * 128 + 1344 + 256
    # GPipe keeps all 4 microbatches on every stage: 16 * 1344 + 4 * 128 edges on rank 0,
    # 16 * 1344 + 4 * (192 + 400) on rank 1, which needs more.
    gpipe = plan_memory(mesh(schedule="gpipe"), 1)
    assert (gpipe.stage, gpipe.activations, gpipe.logits) == (1, 16 * 1344 + 4 * 192, 4 * 400)
    # Interleaved, 2 chunks of 2 blocks per rank: rank 0 holds blocks 0, 1, 4, 5 and keeps
    # min(v m = 8, 2 (pp - 1) + (v - 1) pp + 1 = 5) chunk-microbatches: 5 * 2 * 1344, which is
    # Narayanan et al.'s L (1 + (p - 1) / (p v)) = 8 * 1.25 = 10 block-microbatches.
    interleaved = mesh(schedule="interleaved", stages_per_rank=2)
    assert interleaved.stage_layers == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert plan_memory(interleaved, 1).activations == 10 * 1344 + 3 * 128


def test_communication_bubble_and_step_time():
    setup = mesh()
    sent = plan_communication(setup, 1)
    # FSDP on rank 0: 2100 * 4 bytes gathered in forward and backward for each of the 4
    # microbatches and reduce-scattered once, each moving 3/4 of the buffer over 4 shards.
    assert (sent.all_gather, sent.reduce_scatter, sent.all_reduce) == (50400, 6300, 0)
    # TP: 4 microbatches * 4 blocks * 8 collectives * 1/2 * 4 tokens * 16 d * 2 bytes.
    assert sent.tensor_parallel == 8192
    # PP: 4 microbatches, the float32 [4, 16] output forward and its gradient back, / tp.
    assert sent.pipeline == 4 * 2 * 64 * 4 / 2
    assert plan_communication(mesh(activation_checkpointing=True), 1).tensor_parallel == 12288
    # A layout that exchanges 2 block inputs' worth in all-to-alls per forward (MPT's Wqkv with
    # 4 query and 2 key/value heads): 2 / tp of each block input in forward and backward, a
    # third time recomputed: 4 microbatches * 4 blocks * (2 or 3) * 1 * 1/2 * 4 * 16 * 2.
    exchanging = dataclasses.replace(COUNTS, tp_all_to_all=2.0)
    assert plan_communication(mesh(counts=exchanging), 1).tensor_parallel == 8192 + 2048
    checkpointed = mesh(counts=exchanging, activation_checkpointing=True)
    assert plan_communication(checkpointed, 1).tensor_parallel == 12288 + 3072
    assert bubble_fraction(2, 4) == 1 / 5 and bubble_fraction(1, 4) == 0
    assert bubble_fraction(2, 4, "interleaved", 2) == 1 / 9
    assert bubble_fraction(4, 8, "gpipe") == 3 / 11
    assert step_seconds(6e9, 512, 2048, 8, 1e15, 0.5, bubble=0.2) == pytest.approx(
        6e9 * 512 * 2048 / 8 / 5e14 / 0.8
    )


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"tp": 8, "world_size": 16}, "--tp=8 does not divide the model's n_heads=4, "
         "kv_n_heads=2, vocab_size=50: choose a tp that divides each"),
        ({"tp": 4, "pp": 1, "world_size": 16}, "--tp=4 does not divide the model's kv_n_heads=2"),
        ({"pp": 9, "tp": 1, "world_size": 18}, "--pp=9 exceeds the model's 8 blocks (each "
         "pipeline stage holds at least one); use at most pp=8"),
        ({"pp": 4, "stages_per_rank": 4, "schedule": "interleaved"}, "pp=4 x 4 stages per rank "
         "= 16 stages, more than the model's 8 layers: use --pp 2 or fewer"),
        ({"pp": 3, "world_size": 16}, "tp=2 x pp=3 = 6 does not divide the 16 devices"),
        ({"cp": 3}, "tp=2 x cp=3 x pp=2 = 12 does not divide the 16 devices"),
        ({"dp_shard": 2}, "= 8, but there are 16 devices: use --world-size 8 or leave"),
        ({"schedule": "interleaved"}, "use --schedule interleaved with --stages-per-rank 2"),
        ({"strategy": "deepspeed_zero3"}, "parallelism.tp=2: strategy=deepspeed_zero3 runs the "
         "whole model on every process, without tensor parallelism; use strategy=fsdp, or tp=1"),
        ({"strategy": "fsdp-hybrid"}, "strategy 'fsdp-hybrid': use one of single, ddp, "
         "deepspeed_zero1, deepspeed_zero2, deepspeed_zero3, fsdp"),
        ({"cp": 4, "tp": 1, "pp": 1}, "max_seq_len=4 is not a multiple of 8 (2 x cp=4): the mesh "
         "splits every sequence into that many parts"),
    ],
)  # fmt: skip
def test_impossible_meshes_are_refused(options, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        mesh(**options)


def test_recommends_tp_within_a_node_for_llama_70b_on_16_gpus(capsys):
    # Llama 3.1 70B with AdamW: 70.55e9 * 16 bytes = 1129 GB of weights, gradients and state,
    # 70.6 GB per device over 16 80 GB GPUs: only tp = 8, which splits every activation 8
    # ways, leaves room for an 8k sequence; pp = 1 has no bubble, so tp 8 x pp 1 x dp_shard 2.
    # At 8 GPUs the states alone (141 GB each) rule out every mesh.
    plan_script = runpy.run_path(str(ROOT / "scripts" / "plan.py"))
    common = ["model=llama3-70b", "precision=amp_bf16", "max_seq_len=8192",
              "global_train_batch_size=512", "--recommend", "--activation-checkpointing",
              "--device-memory", "80GB", "--device-name", "H100"]  # fmt: skip
    assert plan_script["main"]([*common, "--world-size", "16"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(
        "recommended : tp 8 x cp 1 x pp 1 x dp_shard 2 x dp_replicate 1 on 16 devices"
    )
    assert "mesh        : dp_replicate 1 x dp_shard 2 x cp 1 x tp 8 x pp 1" in out
    with pytest.raises(SystemExit) as exit_info:
        plan_script["main"]([*common, "--world-size", "8"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("error: no mesh of 8 devices fits 80GB per device") and err.count("\n") == 1
    )


def test_recommend_keeps_pure_fsdp_when_it_fits():
    # Sharded 16 ways, the toy model's states are tiny: no tp or pp is needed.
    choice = recommend(mesh(tp=1, pp=1), 1e6)
    assert (choice.setup.tp, choice.setup.pp, choice.setup.dims.dp_shard) == (1, 1, 16)
    # 25000 bytes: pure FSDP needs 2052.5 + 2052.5 + 4105 (weights, gradients, Adam over 16) + 8000
    # (two gathered blocks) + 8 * 2432 + 640 (activations) + 800 (logits) = 37106; tp 2 (dp 8)
    # 2052.5 + 2052.5 + 4105 + 4000 + 8 * 1344 + 320 + 400 = 23682; pp 2 keeps two microbatches of
    # unsplit activations on rank 0 and does not fit. The fewest model-parallel ways: tp 2.
    tight = recommend(mesh(tp=1, pp=1), 25000)
    assert (tight.setup.tp, tight.setup.pp) == (2, 1)


def test_a_family_without_a_tensor_parallel_plan_gets_no_tp():
    """A family whose config training refuses tp > 1 for (MPT with qk_ln): --tp is refused as
    training would refuse it, and the 25000-byte case above, which only tp 2 fits, gets no
    recommendation at all."""
    qk_ln_8 = MPTConfig(d_model=16, n_heads=4, kv_n_heads=2, n_layers=8, vocab_size=50, qk_ln=True)
    no_tp = dataclasses.replace(COUNTS, plan=count_model(qk_ln_8, 4, "amp_bf16").plan)
    with pytest.raises(ValueError, match="--tp=2: MPT's tensor-parallel layout does not cover"):
        mesh(counts=no_tp)
    assert recommend(mesh(tp=1, pp=1), 25000).setup.tp == 2
    assert recommend(mesh(tp=1, pp=1, counts=no_tp), 25000) is None
    assert recommend(mesh(tp=1, pp=1, counts=no_tp), 1e6).setup.tp == 1
    # Read from each family's plan: MPT's layout exchanges its Wqkv output ((4 + 2 * 2) / 4
    # block inputs), and does not cover qk_ln.
    mpt = MPTConfig(d_model=32, n_heads=4, kv_n_heads=2, n_layers=2, max_seq_len=16, vocab_size=64)
    qk_ln = MPTConfig(d_model=32, n_heads=2, n_layers=2, max_seq_len=16, vocab_size=64, qk_ln=True)
    llama = LlamaConfig(d_model=32, n_heads=2, n_kv_heads=1, n_layers=2, vocab_size=64)
    assert count_model(mpt, 16, "fp32").tp_all_to_all == 2.0
    assert (
        "does not cover model.qk_ln=true"
        in count_model(qk_ln, 16, "fp32").plan.tensor_parallel_refusal
    )
    assert count_model(llama, 16, "fp32").tp_all_to_all == 0.0


def test_plan_script_refuses_an_impossible_mesh_in_one_line():
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "plan.py"), "model=llama3-70b",
         "--strategy", "fsdp", "--world-size", "16", "--tp", "3"],
        cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 2
    assert out.stderr == (
        "error: --tp=3 does not divide the model's n_heads=64, n_kv_heads=8, "
        "ffn_hidden_size=28672: choose a tp that divides each (or a model whose sizes it "
        "divides)\n"
    )
    assert out.stdout == ""


def test_the_cached_attention_bias_is_counted_per_device(monkeypatch):
    """sdpa and torch keep the causal bias cached in the compute dtype: mpt-30b's ALiBi at 8k
    is 56 heads x 8192^2 x 2 bytes = 7 GiB on one GPU, its 28 heads' half on each of tp 2; a
    sliding window without ALiBi is one mask for every head; flex and flash build none."""
    monkeypatch.setattr(flash, "missing_package", lambda: None)  # flash-attn is not needed here
    mpt_30b = MPTConfig(d_model=7168, n_heads=56, n_layers=48, max_seq_len=8192)

    def attn_bias(config, seq_len=8192, precision="amp_bf16", tp=1):
        options = {"strategy": "fsdp", "world_size": tp, "tp": tp}
        return plan_memory(Setup(config, seq_len, precision, **options), 1).attn_bias

    assert attn_bias(mpt_30b) == 56 * 8192**2 * 2 == 7 * 2**30
    assert attn_bias(mpt_30b, tp=2) == 28 * 8192**2 * 2
    assert attn_bias(mpt_30b, seq_len=4096, precision="fp32") == 56 * 8192**2 * 4
    window = dataclasses.replace(mpt_30b, alibi=False, learned_pos_emb=True, sliding_window=1024)
    assert attn_bias(window) == 8192**2 * 2
    for impl in ("flex", "flash"):
        assert attn_bias(dataclasses.replace(mpt_30b, attn_impl=impl)) == 0
    assert attn_bias(dataclasses.replace(window, sliding_window=None)) == 0
    plan = plan_memory(Setup(mpt_30b, 8192), 1)
    flex = plan_memory(Setup(dataclasses.replace(mpt_30b, attn_impl="flex"), 8192), 1)
    assert plan.total - flex.total == plan.attn_bias


def test_a_mesh_training_refuses_is_refused_by_the_planner_too():
    """The planner asked only that tp divide the head counts; training's check_tensor_parallel
    also asks it to divide the widths and the vocabulary (the head is split by vocabulary). An
    odd vocabulary at tp 2 was planned, and then refused by training: now by both, alike, and
    `recommend` offers context parallelism instead."""
    odd_vocab = MPTConfig(d_model=32, n_heads=4, n_layers=2, max_seq_len=64, vocab_size=101)
    plan = parallel_plan(family_of(odd_vocab).build(odd_vocab, init_device="meta"))
    with pytest.raises(ValueError, match="vocab_size=101") as training:
        check_tensor_parallel(plan, 2, setting="--tp")
    with pytest.raises(ValueError, match="vocab_size=101") as planner:
        Setup(odd_vocab, 64, "fp32", strategy="fsdp", world_size=2, tp=2)
    assert str(planner.value) == str(training.value)
    two = Setup(odd_vocab, 64, "fp32", strategy="fsdp", world_size=2, global_batch=2)
    budget = plan_memory(dataclasses.replace(two, cp=2), 1).total
    assert plan_memory(two, 1).total > budget  # pure FSDP does not fit; tp 2 is refused
    choice = recommend(two, budget)
    assert (choice.setup.tp, choice.setup.cp) == (1, 2)


def test_infini_attention_refuses_cp_as_training_does():
    infini = MPTConfig(d_model=32, n_heads=4, n_layers=2, max_seq_len=16, vocab_size=64,
                       infini={"segment_len": 8})  # fmt: skip
    with pytest.raises(ValueError, match="^--cp=2: model.infini's memory runs through each"):
        Setup(infini, 16, "fp32", strategy="fsdp", world_size=2, cp=2)


def test_context_parallelism_divides_activations_and_gathers_keys_and_values():
    """cp=C: each rank holds 1/C of every sequence, so the activations (and logits) shrink
    C-fold; each layer's all-gathered keys and values, [1, 16, kv_dim 8] x 2 x 2 bytes = 512
    per microbatch, are kept per layer for backward (8 blocks, 1 microbatch in flight) plus
    one layer's gradients; FSDP shards over dp_shard x cp (16 ways still)."""

    def cp_mesh(cp, **kwargs):
        options = {"strategy": "fsdp", "world_size": 16, "cp": cp, "global_batch": 16}
        return Setup(None, 16, "amp_bf16", counts=COUNTS, **options, **kwargs)

    one = cp_mesh(1)
    assert one.counts.kv_dim == 8
    base = plan_memory(one, 1)
    for c in (2, 4):
        plan = plan_memory(cp_mesh(c), 1)
        assert plan.activations == base.activations / c and plan.logits == base.logits / c
        assert (plan.params, plan.optimizer) == (base.params, base.optimizer)
        assert plan.gathered_kv == (8 + 1) * 512
    checkpointed = cp_mesh(4, activation_checkpointing=True)
    assert plan_memory(checkpointed, 1).gathered_kv == 2 * 512
    # Sent: 4 microbatches (16 sequences over 4 data-parallel ranks) x 8 layers x (a gather
    # forward, a reduce-scatter backward, a gather again when recomputed) x 3/4 of 512.
    sent = plan_communication(cp_mesh(4), 1)
    assert sent.context_parallel == 4 * 8 * 2 * 0.75 * 512
    assert plan_communication(checkpointed, 1).context_parallel == 4 * 8 * 3 * 0.75 * 512
    assert plan_communication(one, 1).context_parallel == 0


def test_recommends_context_parallelism_for_mpt_7b_at_64k_on_8_gpus(capsys):
    """MPT-7B (ALiBi, sdpa) at 65,536 tokens on 8 x 80 GB: the recommended mesh splits the
    sequence (cp > 1), fits, and sends less than tensor parallelism alone (tp 8, which the
    planner recommended before it knew cp)."""
    plan_script = runpy.run_path(str(ROOT / "scripts" / "plan.py"))
    argv = ["model=mpt-7b", "model.max_seq_len=65536", "max_seq_len=65536", "precision=amp_bf16",
            "global_train_batch_size=8", "--recommend", "--world-size", "8",
            "--activation-checkpointing", "--device-memory", "80GB",
            "--device-name", "H100"]  # fmt: skip
    assert plan_script["main"](argv) == 0
    out = capsys.readouterr().out
    mesh_line = re.search(r"recommended : tp (\d+) x cp (\d+) x pp (\d+)", out)
    tp, cp, pp = map(int, mesh_line.groups())
    assert cp > 1 and tp * cp * pp == 8
    total = float(re.search(r"  total      : +([0-9.]+) GiB", out).group(1))
    assert total <= 80e9 / 2**30
    sent = float(re.search(r"  total         : +([0-9.]+) GiB", out).group(1))
    assert (
        plan_script["main"](
            [a for a in argv if a != "--recommend"] + ["--strategy", "fsdp", "--tp", "8"]
        )
        == 0
    )
    tp_only = capsys.readouterr().out
    assert sent < float(re.search(r"  total         : +([0-9.]+) GiB", tp_only).group(1))


def test_the_plan_script_plans_the_configs_parallelism_block(capsys):
    """The mesh set in the config (as train.py reads it, old strategy.* keys included) is the
    one planned, not silently the flags' defaults; a flag that contradicts it is refused."""
    plan_script = runpy.run_path(str(ROOT / "scripts" / "plan.py"))
    assert plan_script["main"](["strategy=fsdp", "parallelism.cp=2", "--world-size", "4"]) == 0
    assert (
        "mesh        : dp_replicate 1 x dp_shard 2 x cp 2 x tp 1 x pp 1" in capsys.readouterr().out
    )
    with pytest.raises(SystemExit) as exit_info:
        plan_script["main"](["strategy=fsdp", "parallelism.tp=2", "--tp", "4", "--world-size", "4"])
    assert exit_info.value.code == 2
    assert (
        capsys.readouterr().err == "error: --tp 4 and parallelism.tp=2 disagree: give one of them\n"
    )

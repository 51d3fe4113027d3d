"""The memory planner: measured peaks on CPU, published MPT setups, and the script."""

import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from llmfoundry.callbacks.peak_flops import gpu_has_bf16
from llmfoundry.models.families import FAMILIES
from llmfoundry.models.mpt import MPTConfig
from llmfoundry.planning import (
    Setup,
    largest_microbatch,
    optimizer_state_bytes,
    parse_bytes,
    plan_memory,
    planned_precision,
    step_seconds,
)

ROOT = Path(__file__).resolve().parents[2]
MPT_7B = MPTConfig(d_model=4096, n_heads=32, n_layers=32)
MPT_30B = MPTConfig(d_model=7168, n_heads=56, n_layers=48)


def measured_peak(spec: dict) -> int:
    """Peak resident bytes of two training steps (tests/planning/peak_worker.py)."""
    env = {
        **os.environ,
        "MALLOC_MMAP_THRESHOLD_": "65536",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(ROOT),
    }
    out = subprocess.run(
        [sys.executable, "-m", "tests.planning.peak_worker", json.dumps(spec)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])["peak"]


@pytest.mark.slow
@pytest.mark.skipif(
    not os.access("/proc/self/clear_refs", os.W_OK), reason="needs Linux /proc/self/clear_refs"
)
@pytest.mark.parametrize(
    ("shape", "precision"),
    [
        ({"d_model": 256, "n_heads": 4, "n_layers": 4, "vocab_size": 8192, "seq": 256}, "fp32"),
        (
            {"d_model": 128, "n_heads": 4, "n_layers": 8, "vocab_size": 32000, "seq": 128},
            "amp_bf16",
        ),
        # Llama (GQA, SwiGLU, untied head): planned/measured 1.04 when this was written.
        (
            {
                "family": "llama",
                "d_model": 256,
                "n_heads": 4,
                "n_kv_heads": 2,
                "n_layers": 4,
                "vocab_size": 8192,
                "seq": 256,
            },
            "fp32",
        ),  # fmt: skip
    ],
)
def test_plan_is_within_20_percent_of_the_measured_cpu_peak(shape, precision):
    seq = shape["seq"]
    family = FAMILIES[shape.get("family", "mpt")]
    model = {k: v for k, v in shape.items() if k not in ("seq", "family")}
    batch = 8
    measured = measured_peak({**model, "family": family.name, "max_seq_len": seq, "batch": batch,
                              "seq": seq, "precision": precision})  # fmt: skip
    config = family.config_class(**model, max_seq_len=seq)
    planned = plan_memory(Setup(config, seq, precision), batch).total
    assert 0.8 <= planned / measured <= 1.2, (planned, measured)


def test_parameter_count_is_the_published_mpt_7b_count():
    recipe = MPTConfig(d_model=4096, n_heads=32, n_layers=32, alibi=False, no_bias=False)
    assert plan_memory(Setup(recipe, 2048), 1).n_params == 6_658_859_008


def test_published_mpt_setups_are_plausible():
    gb80, gb40 = 80e9, 40e9
    # MPT-7B: FSDP full shard over 8 GPUs with activation checkpointing, microbatch 8 (MosaicML's
    # recipe); Adam's 16 bytes per parameter alone (107 GB) rule out DDP on an 80 GB GPU.
    fsdp_7b = Setup(MPT_7B, 2048, strategy="fsdp", world_size=8, activation_checkpointing=True)
    assert largest_microbatch(fsdp_7b, gb80) >= 8
    assert largest_microbatch(Setup(MPT_7B, 2048, strategy="ddp", world_size=8), gb80) == 0
    # Without checkpointing, activations (about 10 GB per 2048-token sequence) bound it.
    no_ckpt = Setup(MPT_7B, 2048, strategy="fsdp", world_size=8)
    assert 1 <= largest_microbatch(no_ckpt, gb80) < 8
    # MPT-30B: trained on A100-40GB with FSDP and activation checkpointing over hundreds of GPUs.
    fsdp_30b = Setup(MPT_30B, 2048, strategy="fsdp", world_size=512, activation_checkpointing=True)
    assert largest_microbatch(fsdp_30b, gb40) >= 1
    assert (
        largest_microbatch(Setup(MPT_30B, 2048, strategy="deepspeed_zero1", world_size=8), gb80)
        == 0
    )


def test_sharding_and_offload_divide_the_right_parts():
    single = plan_memory(Setup(MPT_7B, 2048), 1)
    zero1 = plan_memory(Setup(MPT_7B, 2048, strategy="deepspeed_zero1", world_size=8), 1)
    zero2 = plan_memory(Setup(MPT_7B, 2048, strategy="deepspeed_zero2", world_size=8), 1)
    fsdp = plan_memory(Setup(MPT_7B, 2048, strategy="fsdp", world_size=8), 1)
    hybrid = plan_memory(Setup(MPT_7B, 2048, strategy="fsdp", world_size=64, dp_replicate=8), 1)
    offload = plan_memory(Setup(MPT_7B, 2048, strategy="fsdp", world_size=8, cpu_offload=True), 1)
    assert zero1.optimizer == single.optimizer / 8 and zero1.grads == single.grads
    assert zero2.grads == single.grads / 8 and zero2.params == single.params
    assert fsdp.params == single.params / 8 and fsdp.working > 0 == single.working
    assert hybrid.params == fsdp.params  # sharded within each of 8 replicas of 8
    assert offload.params == offload.grads == offload.optimizer == 0
    ckpt = plan_memory(Setup(MPT_7B, 2048, activation_checkpointing=True), 1)
    assert ckpt.activations < single.activations / 5
    assert optimizer_state_bytes("llmfoundry.optim.DecoupledLionW") == 4


def test_step_time_and_inputs():
    assert step_seconds(6e9, 512, 2048, 8, 1e15, 0.5) == pytest.approx(6e9 * 512 * 2048 / 8 / 5e14)
    assert parse_bytes("80GB") == 80e9 and parse_bytes("1GiB") == 2**30
    with pytest.raises(ValueError, match="80GB or 141GiB"):
        parse_bytes("80 gigs")
    with pytest.raises(ValueError, match="sharded strategy"):
        Setup(MPT_7B, 2048, strategy="ddp", world_size=2, cpu_offload=True)
    with pytest.raises(ValueError, match="optimizer-state size"):
        optimizer_state_bytes("torch.optim.Adagrad")


def test_plan_script_reads_hydra_overrides(capsys):
    plan_script = runpy.run_path(str(ROOT / "scripts" / "plan.py"))
    argv = ["model=mpt-7b", "precision=amp_bf16", "global_train_batch_size=64", "--strategy",
            "fsdp", "--world-size", "8", "--activation-checkpointing", "--device-memory", "80GB",
            "--device-name", "H100"]  # fmt: skip
    assert plan_script["main"](argv) == 0
    out = capsys.readouterr().out
    assert "parameters  : 6,649,024,512" in out
    assert "largest microbatch fitting 80GB (74.51 GiB): " in out
    assert "at 40% MFU of 989.4 TFLOP/s" in out


def test_auto_plans_what_training_resolves_on_the_named_gpu(capsys):
    """The default precision=auto: bf16 on an H100 (or when no GPU is named), fp32 on a V100
    (no bf16 tensor cores), as the trainer resolves it; a named precision is kept."""
    assert gpu_has_bf16("NVIDIA H100 80GB HBM3") and not gpu_has_bf16("Tesla V100-SXM2-32GB")
    assert planned_precision("auto", has_bf16=True) == "amp_bf16"
    assert planned_precision("auto", has_bf16=False) == "fp32"
    assert planned_precision("amp_fp16", has_bf16=False) == "amp_fp16"
    plan_script = runpy.run_path(str(ROOT / "scripts" / "plan.py"))
    for name, precision, peak in (("H100", "amp_bf16", 989.4), ("V100", "fp32", 15.7)):
        argv = ["model=mpt-125m", "--device-memory", "32GB", "--device-name", name]
        assert plan_script["main"](argv) == 0
        out = capsys.readouterr().out
        assert f"; {precision}; global batch" in out and f"MFU of {peak} TFLOP/s" in out


def test_plan_script_counts_a_llama_model(capsys):
    plan_script = runpy.run_path(str(ROOT / "scripts" / "plan.py"))
    argv = ["model=llama3-70b", "precision=amp_bf16", "max_seq_len=8192",
            "global_train_batch_size=512", "--strategy", "fsdp",
            "--world-size", "64", "--activation-checkpointing", "--device-memory", "80GB",
            "--device-name", "H100"]  # fmt: skip
    assert plan_script["main"](argv) == 0
    out = capsys.readouterr().out
    assert "model       : LlamaConfig d_model 8192, 80 layers, vocab 128256, seq 8192" in out
    assert "parameters  : 70,553,706,496" in out  # Meta's published Llama 3.1 70B count


def test_plan_script_refuses_a_setup_that_does_not_fit(capsys):
    plan_script = runpy.run_path(str(ROOT / "scripts" / "plan.py"))
    argv = ["model=mpt-70b", "precision=amp_bf16", "--strategy", "ddp", "--world-size", "8",
            "--device-memory", "40GB", "--device-name", "A100"]  # fmt: skip
    assert plan_script["main"](argv) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert len(err.splitlines()) == 1
    assert err.startswith("error: not even 1 sequence per device fits 40GB (37.25 GiB)")
    assert "--strategy fsdp" in err and "--activation-checkpointing" in err
    assert "step time" not in captured.out


def test_plan_script_input_errors_are_one_line(capsys):
    plan_script = runpy.run_path(str(ROOT / "scripts" / "plan.py"))
    with pytest.raises(SystemExit) as exit_info:
        plan_script["main"](["--world-size", "8", "--device-memory", "40GB"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == (
        "error: strategy=single runs one process, but there are 8: use strategy=ddp or "
        "strategy=fsdp\n"
    )


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--tp", "3", "--world-size", "8"],
         "error: --tp=3 does not divide the model's n_heads=4, kv_n_heads=4, expansion_ratio * "
         "d_model=1024, vocab_size=8192: choose a tp that divides each (or a model whose sizes "
         "it divides)\n"),
        (["--tp", "2", "--world-size", "3"],
         "error: tp=2 x pp=1 = 2 does not divide the 3 devices: use a --world-size that is a "
         "multiple of 2, or axes whose product divides 3\n"),
    ],
)  # fmt: skip
def test_plan_script_names_the_mesh_problem_not_the_strategy(flags, message, capsys):
    """The default strategy (single) used to answer any tp with 'use --world-size tp x pp',
    though the heads or the device count were what tp broke."""
    plan_script = runpy.run_path(str(ROOT / "scripts" / "plan.py"))
    with pytest.raises(SystemExit) as exit_info:
        plan_script["main"](flags)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == message

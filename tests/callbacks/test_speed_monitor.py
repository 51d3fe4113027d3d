import logging
import time

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    apply_activation_checkpointing,
)

from llmfoundry.callbacks import SpeedMonitor, peak_flops, speed_monitor
from llmfoundry.models.layers.decoder import Block
from llmfoundry.models.mpt import MPTForCausalLM
from llmfoundry.trainer import Callback
from llmfoundry.utils.logs import configure_logging
from tests.trainer.conftest import tiny_model, token_batches

from .conftest import Recorder, make_trainer

TOKENS_PER_BATCH = 4 * 16  # batch_size 4, seq_len 16


class FakeClock(Callback):
    """Time that moves only when told: `batch_seconds[i]` in batch i, `eval_seconds` per eval."""

    def __init__(self, batch_seconds, eval_seconds=0.0):
        self.now = 1000.0
        self.batch_seconds = list(batch_seconds)
        self.eval_seconds = eval_seconds

    def __call__(self):
        return self.now

    def batch_start(self, state, logger):
        self.now += self.batch_seconds[state.timestamp.batch]

    def eval_start(self, state, logger):
        self.now += self.eval_seconds


def run_with_clock(tmp_path, monkeypatch, clock, monitor, **kwargs):
    monkeypatch.setattr(speed_monitor, "perf_counter", clock)
    recorder = Recorder()
    trainer = make_trainer(
        tmp_path,
        n_batches=len(clock.batch_seconds),
        callbacks=[clock, monitor],
        loggers=[recorder],
        **kwargs,
    )
    return trainer, recorder


def test_rates_and_mfu_with_known_clock_and_peak(tmp_path, monkeypatch):
    clock = FakeClock([0.5, 0.5, 0.5])
    trainer, recorder = run_with_clock(
        tmp_path, monkeypatch, clock, SpeedMonitor(window_size=2, peak_flops=1e9)
    )
    flops_per_token = trainer.state.model.flops_per_token(16)
    trainer.fit()
    steps = [step for step, _ in recorder.values("throughput/mfu")]
    assert steps == [1, 2, 3]
    metrics = recorder.calls[-1][1]
    assert metrics["throughput/batches_per_sec"] == pytest.approx(2.0)
    assert metrics["throughput/samples_per_sec"] == pytest.approx(8.0)
    assert metrics["throughput/tokens_per_sec"] == pytest.approx(2 * TOKENS_PER_BATCH)
    assert metrics["throughput/device/tokens_per_sec"] == pytest.approx(2 * TOKENS_PER_BATCH)
    device_flops = 2 * TOKENS_PER_BATCH * flops_per_token
    assert metrics["throughput/device/flops_per_sec"] == pytest.approx(device_flops)
    assert metrics["throughput/mfu"] == pytest.approx(device_flops / 1e9)
    # No activation checkpointing: nothing is computed twice.
    assert metrics["throughput/hfu"] == metrics["throughput/mfu"]


def test_window_slides_over_the_last_batches(tmp_path, monkeypatch):
    clock = FakeClock([1.0, 2.0, 3.0, 4.0])
    trainer, recorder = run_with_clock(
        tmp_path, monkeypatch, clock, SpeedMonitor(window_size=2, peak_flops=1e9)
    )
    trainer.fit()
    # batch 1 over 1 s; batch 1-2 over 3 s; then the last two batches: 2-3 over 5 s, 3-4 over 7 s.
    assert [v for _, v in recorder.values("throughput/batches_per_sec")] == pytest.approx(
        [1 / 1, 2 / 3, 2 / 5, 2 / 7]
    )


def test_evaluation_time_is_not_training_time(tmp_path, monkeypatch):
    clock = FakeClock([1.0, 1.0, 1.0, 1.0], eval_seconds=100.0)
    trainer, recorder = run_with_clock(
        tmp_path,
        monkeypatch,
        clock,
        SpeedMonitor(window_size=4, peak_flops=1e9),
        eval_dataloaders={"val": token_batches(2, 4, seed=1)},
        eval_interval="1ba",
    )
    trainer.fit()
    assert [v for _, v in recorder.values("throughput/tokens_per_sec")] == pytest.approx(
        [TOKENS_PER_BATCH] * 4
    )


def test_hfu_counts_the_recomputed_forward_under_activation_checkpointing(tmp_path, monkeypatch):
    clock = FakeClock([0.5, 0.5])
    trainer, recorder = run_with_clock(tmp_path, monkeypatch, clock, SpeedMonitor(peak_flops=1e9))
    apply_activation_checkpointing(trainer.state.model, check_fn=lambda m: isinstance(m, Block))
    trainer.fit()
    metrics = recorder.calls[-1][1]
    assert metrics["throughput/hfu"] == pytest.approx(metrics["throughput/mfu"] * 4 / 3)


def test_peak_from_device_table_by_name_and_precision():
    assert peak_flops.gpu_peak_flops("NVIDIA H100 80GB HBM3", "bf16") == 989.4e12
    assert peak_flops.gpu_peak_flops("NVIDIA H200", "bf16") == 989.4e12
    assert peak_flops.gpu_peak_flops("NVIDIA H100 PCIe", "bf16") == 756e12
    assert peak_flops.gpu_peak_flops("NVIDIA A100-SXM4-80GB", "bf16") == 312e12
    assert peak_flops.gpu_peak_flops("NVIDIA A100-SXM4-80GB", "fp32") == 19.5e12
    assert peak_flops.gpu_peak_flops("NVIDIA A100-SXM4-80GB", "tf32") == 156e12
    assert peak_flops.gpu_peak_flops("NVIDIA A10", "bf16") == 125e12
    assert peak_flops.gpu_peak_flops("NVIDIA L4", "fp16") == 121e12
    assert peak_flops.gpu_peak_flops("NVIDIA L40S", "bf16") == 362.05e12
    assert peak_flops.gpu_peak_flops("Tesla V100-SXM2-16GB", "fp16") == 125e12
    # V100 has no bf16 tensor cores; an A10G is not an A10; unknown names have no peak.
    assert peak_flops.gpu_peak_flops("Tesla V100-SXM2-16GB", "bf16") is None
    assert peak_flops.gpu_peak_flops("NVIDIA A10G", "bf16") is None
    assert peak_flops.gpu_peak_flops("Some Future GPU", "bf16") is None


def test_fp32_matmuls_count_as_tf32_when_torch_allows_it():
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert peak_flops.number_format("fp32") == "fp32"
        torch.set_float32_matmul_precision("high")
        assert peak_flops.number_format("fp32") == "tf32"
    finally:
        torch.set_float32_matmul_precision(before)
    assert peak_flops.number_format("amp_bf16") == "bf16"
    with pytest.raises(ValueError, match="unknown precision"):
        peak_flops.number_format("fp8")


@pytest.mark.parametrize("precision, dtype_name", [("fp32", "float32"), ("amp_bf16", "bfloat16")])
def test_cpu_peak_is_measured_in_the_runs_precision(precision, dtype_name):
    peak, source = peak_flops.device_peak_flops(torch.device("cpu"), precision)
    assert source.startswith(f"measured: {dtype_name}")
    assert 1e8 < peak < 1e15  # any CPU from a laptop to a large server, in flop/s


def test_cpu_benchmark_leaves_the_training_rng_untouched():
    peak_flops.measure_cpu_peak_flops.cache_clear()
    torch.manual_seed(0)
    before = torch.get_rng_state()
    peak_flops.measure_cpu_peak_flops(torch.float32, torch.get_num_threads())
    assert torch.equal(torch.get_rng_state(), before)


class TickingClock:
    """Reports every matmul as taking `seconds`, whatever its size."""

    def __init__(self, seconds: float) -> None:
        self.now, self.seconds = 0.0, seconds

    def __call__(self) -> float:
        self.now += self.seconds  # so any two successive reads are `seconds` apart
        return self.now


@pytest.mark.parametrize("seconds, size", [(1.0, 256), (0.03, 256), (0.01, 1024)])
def test_cpu_benchmark_grows_the_matmul_only_while_it_is_quick(seconds, size, monkeypatch):
    # A format without fast kernels (bf16 on an AVX2 CPU: ~1 GFLOP/s) would take a minute at
    # the largest size; a matmul that already takes >= _CPU_BENCH_SLOW_S is measured as it is.
    monkeypatch.setattr(peak_flops, "_CPU_BENCH_SIZE", 1024)
    peak_flops.measure_cpu_peak_flops.cache_clear()
    peak = peak_flops.measure_cpu_peak_flops(torch.float32, 1, TickingClock(seconds))
    peak_flops.measure_cpu_peak_flops.cache_clear()
    assert peak == pytest.approx(2 * size**3 / seconds)


class _Descheduled:
    """torch as the CPU benchmark sees it when another process takes the core: every matmul
    waits `seconds` of wall time without running."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __getattr__(self, name):
        return getattr(torch, name)

    def mm(self, a, b):
        time.sleep(self.seconds)
        return torch.mm(a, b)


def test_cpu_mfu_stays_below_one_when_the_peak_benchmark_was_descheduled(tmp_path, monkeypatch):
    # A busy machine: the wall clock would count the other process's time into the peak (read
    # ~0.17 GFLOP/s here) and the run would log MFU of several hundred percent.
    monkeypatch.setattr(peak_flops, "torch", _Descheduled(0.2))
    peak_flops.measure_cpu_peak_flops.cache_clear()
    recorder = Recorder()
    try:
        make_trainer(tmp_path, n_batches=3, callbacks=[SpeedMonitor()], loggers=[recorder]).fit()
    finally:
        peak_flops.measure_cpu_peak_flops.cache_clear()
    mfu = [value for _, value in recorder.values("throughput/mfu")]
    assert len(mfu) == 3
    assert all(0 < value < 1 for value in mfu), mfu


def test_unknown_peak_logs_throughput_without_mfu_and_says_how_to_fix(
    tmp_path, monkeypatch, caplog
):
    monkeypatch.setattr(
        speed_monitor, "device_peak_flops", lambda device, precision, clock: (None, "no peak")
    )
    recorder = Recorder()
    trainer = make_trainer(tmp_path, n_batches=2, callbacks=[SpeedMonitor()], loggers=[recorder])
    trainer.fit()
    assert "set callbacks.speed_monitor.peak_flops=<flop/s per device>" in caplog.text
    names = set().union(*(m for _, m in recorder.calls))
    assert "throughput/tokens_per_sec" in names
    assert "throughput/mfu" not in names


class UserModule(MPTForCausalLM):
    """A user's own module (model=custom): it trains, but has no flops_per_token method."""

    flops_per_token = None


def test_a_model_without_flops_per_token_is_told_once_in_one_line_what_to_add(tmp_path, capsys):
    """Under torchrun every rank printed Python's two-line UserWarning; rank 0 now logs one line
    naming the method and signature the monitor reads, and the other ranks stay silent."""
    for rank in (0, 1):
        configure_logging(rank=rank)
        model = UserModule(tiny_model().config)
        monitor = SpeedMonitor(peak_flops=1e12)
        make_trainer(tmp_path / str(rank), n_batches=1, callbacks=[monitor], model=model).fit()
    said = [line for line in capsys.readouterr().err.splitlines() if "flops_per_token" in line]
    assert said == [
        "warning: speed monitor: MFU is not logged: UserModule has no flops_per_token; add a "
        "method `def flops_per_token(self, seq_len: int) -> int` returning training flops per "
        "token (forward + backward, ~6 * params + 12 * n_layers * d_model * seq_len)"
    ]


def test_override_beats_lookup(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="llmfoundry")
    monkeypatch.setattr(speed_monitor, "device_peak_flops", lambda *args: pytest.fail("looked up"))
    make_trainer(tmp_path, n_batches=1, callbacks=[SpeedMonitor(peak_flops=2e12)]).fit()
    assert "peak 2000.0 GFLOP/s per device (set by speed_monitor.peak_flops)" in caplog.text


def test_bad_arguments():
    with pytest.raises(ValueError, match="window_size"):
        SpeedMonitor(window_size=0)
    with pytest.raises(ValueError, match="peak_flops"):
        SpeedMonitor(peak_flops=0)


def test_cpu_mfu_is_the_logged_cpu_time_rate_over_the_peak(tmp_path, monkeypatch):
    """On a CPU, MFU is timed in process CPU time while flops_per_sec is on the wall clock: a
    process that had the cores a quarter of the time logged mfu 0.72 beside 29 GFLOP/s against a
    157 GFLOP/s peak. The rate MFU is computed from is logged too, so the numbers agree."""
    wall = FakeClock([1.0, 1.0, 1.0])
    cpu = FakeClock([0.25, 0.25, 0.25])  # this process ran a quarter of the wall time
    monkeypatch.setattr(speed_monitor, "process_time", cpu)
    monkeypatch.setattr(speed_monitor, "device_peak_flops", lambda *args: (1e9, "test"))
    monkeypatch.setattr(speed_monitor, "perf_counter", wall)
    recorder = Recorder()
    trainer = make_trainer(
        tmp_path, n_batches=3, callbacks=[wall, cpu, SpeedMonitor(window_size=2)],
        loggers=[recorder],
    )  # fmt: skip
    flops_per_token = trainer.state.model.flops_per_token(16)
    trainer.fit()
    metrics = recorder.calls[-1][1]
    device_flops = TOKENS_PER_BATCH * flops_per_token
    assert metrics["throughput/device/flops_per_sec"] == pytest.approx(device_flops)
    assert metrics["throughput/device/flops_per_cpu_sec"] == pytest.approx(4 * device_flops)
    assert metrics["throughput/mfu"] == pytest.approx(
        metrics["throughput/device/flops_per_cpu_sec"] / 1e9
    )

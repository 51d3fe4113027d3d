import pytest
import torch

from llmfoundry.callbacks import (
    LRMonitor,
    MemoryMonitor,
    RuntimeEstimator,
    SpeedMonitor,
    peak_flops,
    runtime_estimator,
)
from llmfoundry.distributed import SingleDevice
from llmfoundry.optim import LinearWithWarmup
from llmfoundry.trainer import Callback

from .conftest import Recorder, make_trainer


def test_lr_monitor_logs_the_lr_each_step_was_taken_with(tmp_path):
    class ReadLR(Callback):
        seen = []

        def batch_end(self, state, logger):
            self.seen.append([group["lr"] for group in state.optimizer.param_groups])

    recorder = Recorder()
    make_trainer(
        tmp_path,
        n_batches=4,
        lr=0.1,
        scheduler=LinearWithWarmup(t_warmup="2ba"),
        callbacks=[LRMonitor(), ReadLR()],
        loggers=[recorder],
    ).fit()
    logged = [
        [m[k] for k in sorted(m) if k.startswith("lr/group")]
        for _, m in recorder.calls
        if "lr/group0" in m
    ]
    assert logged == ReadLR.seen
    lrs = [lr for _, lr in recorder.values("lr/group0")]
    assert len(lrs) == 4 and lrs[0] < lrs[1]  # warming up


def test_memory_monitor_reports_process_memory_on_cpu(tmp_path):
    recorder = Recorder()
    make_trainer(
        tmp_path,
        n_batches=2,
        strategy=SingleDevice("cpu"),  # the default device is a GPU where there is one
        callbacks=[MemoryMonitor()],
        loggers=[recorder],
    ).fit()
    (_, rss), (_, peak) = (
        recorder.values("memory/rss_gib")[-1],
        recorder.values("memory/peak_rss_gib")[-1],
    )
    # torch alone keeps well over 50 MiB resident; nothing here needs 64 GiB.
    assert 0.05 < rss <= peak * 1.01 < 64


class StepClock(Callback):
    """Each batch takes `seconds[i]` of fake time."""

    def __init__(self, seconds):
        self.now, self.seconds = 0.0, seconds

    def __call__(self):
        return self.now

    def batch_start(self, state, logger):
        self.now += self.seconds[state.timestamp.batch]


def test_runtime_estimator_extrapolates_after_the_skipped_batches(tmp_path, monkeypatch):
    clock = StepClock([30.0, 2.0, 2.0, 2.0, 2.0])  # a slow first batch (warm-up)
    monkeypatch.setattr(runtime_estimator, "perf_counter", clock)
    recorder = Recorder()
    make_trainer(
        tmp_path,
        n_batches=5,
        callbacks=[clock, RuntimeEstimator(skip_batches=1)],
        loggers=[recorder],
    ).fit()
    # The first batch is skipped: 2 s per batch from then on.
    estimates = recorder.values("time/remaining_estimate")
    assert [step for step, _ in estimates] == [2, 3, 4, 5]
    assert [seconds for _, seconds in estimates] == pytest.approx([6.0, 4.0, 2.0, 0.0])
    assert [v for _, v in recorder.values("time/elapsed")] == pytest.approx([30, 32, 34, 36, 38])


def test_runtime_estimator_in_tokens(tmp_path, monkeypatch):
    clock = StepClock([1.0] * 4)
    monkeypatch.setattr(runtime_estimator, "perf_counter", clock)
    recorder = Recorder()
    # 4 batches of 64 tokens; max_duration in tokens, no batch skipped.
    make_trainer(
        tmp_path,
        n_batches=4,
        max_duration="256tok",
        callbacks=[clock, RuntimeEstimator(skip_batches=0)],
        loggers=[recorder],
    ).fit()
    assert [v for _, v in recorder.values("time/remaining_estimate")] == pytest.approx(
        [3.0, 2.0, 1.0, 0.0]
    )


def test_runtime_estimator_rejects_negative_skip():
    with pytest.raises(ValueError, match="skip_batches"):
        RuntimeEstimator(skip_batches=-1)


@pytest.mark.cuda  # CUDA allocator statistics need a GPU
def test_memory_and_mfu_on_a_gpu(tmp_path):
    recorder = Recorder()
    make_trainer(
        tmp_path,
        n_batches=3,
        strategy=SingleDevice("cuda"),
        precision="amp_bf16",
        callbacks=[MemoryMonitor(), SpeedMonitor()],
        loggers=[recorder],
    ).fit()
    metrics = recorder.calls[-1][1] | recorder.calls[-2][1]
    assert 0 < metrics["memory/allocated_gib"] <= metrics["memory/peak_allocated_gib"]
    assert metrics["memory/peak_allocated_gib"] <= metrics["memory/peak_reserved_gib"]
    name = torch.cuda.get_device_name()
    if peak_flops.gpu_peak_flops(name, "bf16") is not None:
        assert 0 < metrics["throughput/mfu"] < 1, name


@pytest.mark.parametrize("seconds_per_batch, warned", [(35.0, True), (1.0, False)])
def test_runtime_estimator_says_once_when_the_run_projects_far_beyond_the_expected_time(
    tmp_path, monkeypatch, caplog, seconds_per_batch, warned
):
    # 600 batches expected in 13 minutes (1.3 s each); at 35 s per batch the run takes hours.
    n_batches = 8
    clock = StepClock([seconds_per_batch] * n_batches)
    monkeypatch.setattr(runtime_estimator, "perf_counter", clock)
    estimator = RuntimeEstimator(expected_minutes=13 * n_batches / 600, hint="try make demo-quick")
    caplog.set_level("WARNING", logger="llmfoundry")
    make_trainer(tmp_path, n_batches=n_batches, callbacks=[clock, estimator]).fit()
    lines = [r.getMessage() for r in caplog.records if "projects" in r.getMessage()]
    if warned:
        assert len(lines) == 1
        assert "projects 5 min in total" in lines[0] and lines[0].endswith("try make demo-quick")
    else:
        assert lines == []


def test_runtime_estimator_rejects_a_non_positive_expected_time():
    with pytest.raises(ValueError, match="expected_minutes"):
        RuntimeEstimator(expected_minutes=0)

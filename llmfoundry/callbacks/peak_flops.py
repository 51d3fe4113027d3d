"""The peak matmul throughput of one device, the denominator of MFU.

MFU is only comparable between runs when the peak is the right one for the device *and* the
number format the matmuls run in, so the peak is looked up by the CUDA device name and the run's
precision, measured on CPUs (whose peak depends on cores, clocks and ISA extensions no table can
know), and can always be overridden (`SpeedMonitor(peak_flops=...)`).
"""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Callable

import torch

# Dense (no structured sparsity) tensor-core peaks in flop/s from the vendors' datasheets, for
# the SXM/OAM part unless the name says otherwise. "tf32" is what fp32 matmuls run at when
# torch allows TF32 (torch.set_float32_matmul_precision("high")). First match wins, so more
# specific patterns come first. A format missing from an entry has no tensor-core support.
_GPU_PEAKS: tuple[tuple[str, dict[str, float]], ...] = (
    (r"H[12]00.*NVL", {"fp32": 60e12, "tf32": 417.5e12, "bf16": 835.5e12, "fp16": 835.5e12}),
    (r"H100.*PCIe", {"fp32": 51.2e12, "tf32": 378e12, "bf16": 756e12, "fp16": 756e12}),
    (r"GH200|H100|H200", {"fp32": 66.9e12, "tf32": 494.7e12, "bf16": 989.4e12, "fp16": 989.4e12}),
    (r"B200", {"bf16": 2250e12, "fp16": 2250e12}),
    (r"A100|A800", {"fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12, "fp16": 312e12}),
    (r"L40S", {"fp32": 91.6e12, "tf32": 183e12, "bf16": 362.05e12, "fp16": 362.05e12}),
    (r"L40\b", {"fp32": 90.5e12, "tf32": 90.5e12, "bf16": 181e12, "fp16": 181e12}),
    (r"\bL4\b", {"fp32": 30.3e12, "tf32": 60e12, "bf16": 121e12, "fp16": 121e12}),
    (r"\bA10\b", {"fp32": 31.2e12, "tf32": 62.5e12, "bf16": 125e12, "fp16": 125e12}),
    (r"V100.*PCIE", {"fp32": 14e12, "fp16": 112e12}),
    (r"V100", {"fp32": 15.7e12, "fp16": 125e12}),
    (r"\bT4\b", {"fp32": 8.1e12, "fp16": 65e12}),
    (r"MI300X", {"fp32": 163.4e12, "tf32": 653.7e12, "bf16": 1307.4e12, "fp16": 1307.4e12}),
    (r"MI250X", {"fp32": 95.7e12, "bf16": 383e12, "fp16": 383e12}),
)

# Square matmul size of the CPU benchmark: large enough to reach the BLAS kernels' steady state,
# small enough to take well under a second in fp32 on a laptop. A format the CPU has no fast
# kernel for (bf16 without AVX512-BF16/AMX runs ~40x slower than fp32) would take a minute at that
# size, so the size doubles from _CPU_BENCH_MIN_SIZE only while one matmul is quicker than
# _CPU_BENCH_SLOW_S: a matmul that slow is already at its steady state (fp32 on one core: 1024
# read 98 GFLOP/s, 2048 read 94; stopping at 1024 takes 0.4 s of CPU at the start of every CPU
# run, going on to 2048 took 1.05 s). The best of at least _CPU_BENCH_REPEATS runs and
# _CPU_BENCH_SECONDS of runs counts: fast formats (bf16 on AMX) get more tries, so a moment of
# contention from another process does not set the peak.
_CPU_BENCH_SIZE = 2048
_CPU_BENCH_MIN_SIZE = 256
_CPU_BENCH_SLOW_S = 0.02
_CPU_BENCH_REPEATS = 3
_CPU_BENCH_SECONDS = 0.3


def number_format(precision: str) -> str:
    """The format the matmuls of a run in `precision` execute in on a CUDA device."""
    if precision == "amp_bf16":
        return "bf16"
    if precision == "amp_fp16":
        return "fp16"
    if precision == "fp32":
        return "fp32" if torch.get_float32_matmul_precision() == "highest" else "tf32"
    raise ValueError(f"unknown precision {precision!r}: use fp32, amp_bf16 or amp_fp16")


def _gpu_peaks(device_name: str) -> dict[str, float] | None:
    for pattern, peaks in _GPU_PEAKS:
        if re.search(pattern, device_name, re.IGNORECASE):
            return peaks
    return None


def gpu_peak_flops(device_name: str, fmt: str) -> float | None:
    """The datasheet peak of a GPU named like torch.cuda.get_device_name(), or None if unknown."""
    peaks = _gpu_peaks(device_name)
    return None if peaks is None else peaks.get(fmt)


def gpu_has_bf16(device_name: str) -> bool:
    """Whether a GPU named so has bf16 tensor cores: all but those listed without a bf16 peak
    (V100, T4: before compute capability 8.0); a name the table lacks is taken for a newer GPU."""
    peaks = _gpu_peaks(device_name)
    return peaks is None or "bf16" in peaks


@functools.cache
def measure_cpu_peak_flops(
    dtype: torch.dtype, threads: int, clock: Callable[[], float] = time.perf_counter
) -> float:
    """The best flop/s of a square matmul in `dtype` on `threads` CPU threads.

    `clock` times each matmul; a benchmark timing its steps in process CPU time (one thread, a
    shared machine) passes `time.process_time` so that its MFU compares like with like.

    Cached per process: the number describes the machine, and re-measuring it on every fit
    would add the benchmark to every run. Uses its own generator so the run's RNG stream is
    untouched (resumed runs must see the same random numbers as uninterrupted ones).
    """
    generator = torch.Generator().manual_seed(0)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        n = _CPU_BENCH_MIN_SIZE
        while True:
            a = torch.randn(n, n, generator=generator).to(dtype)
            b = torch.randn(n, n, generator=generator).to(dtype)
            torch.mm(a, b)  # warm-up: thread pool start, kernel selection
            start = clock()
            torch.mm(a, b)
            if n >= _CPU_BENCH_SIZE or clock() - start >= _CPU_BENCH_SLOW_S:
                break
            n *= 2
        times: list[float] = []
        while len(times) < _CPU_BENCH_REPEATS or sum(times) < _CPU_BENCH_SECONDS:
            start = clock()
            torch.mm(a, b)
            times.append(clock() - start)
    finally:
        torch.set_num_threads(previous)
    return 2 * n**3 / min(times)


def device_peak_flops(
    device: torch.device, precision: str, cpu_clock: Callable[[], float] = time.perf_counter
) -> tuple[float | None, str]:
    """Peak flop/s of `device` for a run in `precision`, and a phrase saying where it came from.

    None when the device is unknown: the caller then reports throughput without MFU and asks for
    an explicit peak rather than guess. `cpu_clock` times the CPU benchmark (see
    `measure_cpu_peak_flops`).
    """
    if device.type == "cpu":
        dtype = torch.bfloat16 if precision == "amp_bf16" else torch.float32
        threads = torch.get_num_threads()
        peak = measure_cpu_peak_flops(dtype, threads, cpu_clock)
        name = str(dtype).removeprefix("torch.")
        clock = getattr(cpu_clock, "__name__", type(cpu_clock).__name__)
        return (
            peak,
            f"measured: {name} square matmul (up to {_CPU_BENCH_SIZE}) on {threads} threads, "
            f"timed by {clock}",
        )
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        fmt = number_format(precision)
        peak = gpu_peak_flops(name, fmt)
        return peak, f"datasheet: {name}, {fmt} dense"
    return None, f"no peak known for device type {device.type!r}"

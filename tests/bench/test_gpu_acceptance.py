"""bench/gpu_acceptance.sh: the script a lent GPU runs first, dry-run on CPU so it never breaks."""

import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PHASES = [
    "prepare",
    "cuda_tests",
    "parity",
    "families",
    "kv_cache",
    "fsdp_resume",
    "oom",
    "serve",
    "fp8",
    "throughput",
    "cuda_compile_tests",
]
NEEDS_CUDA = {"oom", "fp8"}  # a real out-of-memory error, float8 matmuls


@pytest.mark.slow
def test_cpu_dry_run_runs_every_phase(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "WHEELS": str(tmp_path / "no-wheels")}
    out = tmp_path / "out"
    done = subprocess.run(
        ["bash", "bench/gpu_acceptance.sh", "--device", "cpu", "--out", str(out)]
        + ["--work", str(tmp_path / "work"), "--deadline-s", "1500"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    results = {r["phase"]: r for r in lines[:-1]}
    assert sorted(results) == sorted(PHASES)
    for name, result in results.items():
        expected = "skipped" if name in NEEDS_CUDA else "ok"
        assert result["status"] == expected, (name, result)
    assert "CUDA" in results["oom"]["reason"] and "on cpu" in results["fp8"]["reason"]
    assert lines[-1]["summary"] == {n: r["status"] for n, r in results.items()}
    assert (out / "results.jsonl").read_text().splitlines() == done.stdout.splitlines()[:-1]
    # What each phase measured is there, not only its status.
    assert results["cuda_tests"]["selected"] > 0 and results["cuda_compile_tests"]["selected"] > 0
    assert all(c["kernels"] for c in results["parity"]["cases"])
    families = results["families"]
    assert {c["family"] for c in families["cases"]} == {"qwen3", "qwen3_moe"}
    # torch 2.13's CPU kernel runs bfloat16: the MoE's experts took the grouped multiply in
    # the autocast dtype, in the check and in the model's training steps.
    assert families["grouped_mm_runs"] and families["experts_grouped"] and families["equal"]
    assert [t["experts_grouped"] for t in families["training"]] == [None, True]
    assert results["fsdp_resume"]["bitwise"] and results["fsdp_resume"]["steps_compared"] == 2
    assert [r["tokens_per_s"] > 0 for r in results["throughput"]["rows"]] == [True]
    assert {p.name for p in (out / "logs").iterdir()} >= {"prepare.log", "serve.log"}


def test_unknown_phase_is_refused(capsys):
    main = runpy.run_path(str(ROOT / "bench" / "gpu_acceptance.py"))["main"]
    assert main(["--device", "cpu", "--only", "parity,nope"]) == 2
    assert "unknown phase(s) ['nope']" in capsys.readouterr().err

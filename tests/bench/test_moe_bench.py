"""bench/moe.py: its report on results made here (the target, the ratios, the planned column), and
a tiny run end to end (two trainings on a tiny corpus, then the all-to-all count at ep 2 on
gloo)."""

import argparse
import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "moe.py"


def test_the_report_compares_the_moe_with_the_dense_model_of_the_same_run():
    bench = runpy.run_path(str(SCRIPT))
    args = argparse.Namespace(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, data="d",
                              batches=10, batch=8, lr=3e-3, seed=17, threads=1, experts=8,
                              expert_hidden=32, top_k=2, aux_loss_weight=0.02, a2a_rows=2)  # fmt: skip

    def side(params, active, loss, cpu_speed):
        return {"params": params, "active_params": active, "tokens": 20480, "val_loss": loss,
                "tokens_per_cpu_s": cpu_speed, "tokens_per_s": cpu_speed / 2}  # fmt: skip

    results = {"dense": side(1000, 1000, 5.5, 4000), "moe": side(2500, 1016, 5.25, 3000)}
    exchanges = [
        {"ep": 1, "measured_mean": 0, "measured_max": 0, "forward_mean": 0, "planned": 0},
        {"ep": 2, "measured_mean": 1100, "measured_max": 1200, "forward_mean": 550,
         "planned": 1000},
    ]  # fmt: skip
    out = bench["report"](results, exchanges, args, 256)
    assert "| moe | 2,500 | 1,016 | 20,480 | 5.2500 | 3,000 | 1,500 |" in out
    assert "MoE - dense val loss: -0.2500 (lower: target met); speed MoE / dense: 0.75" in out
    assert re.search(r"^\| 2 \| 1,100 \| 1,200 \| 550 \| 1,000 \| 1\.10 \|$", out, re.M)
    assert re.search(r"^\| 1 \| 0 \| 0 \| 0 \| 0 \| - \|$", out, re.M)
    results["moe"]["val_loss"] = 5.75
    assert "(not lower: target MISSED)" in bench["report"](results, exchanges, args, 256)


@pytest.mark.slow
def test_a_tiny_run_trains_both_sides_and_counts_the_all_to_alls(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, path in enumerate(sorted((ROOT / "llmfoundry" / "models").rglob("*.py"))[:20]):
        (corpus / f"doc{i}.txt").write_text(path.read_text())

    def run(script, *argv):
        assert runpy.run_path(str(script))["main"]([*map(str, argv)]) == 0

    run(ROOT / "data_prep/text_to_tokens.py", corpus, "--train-tokenizer", "--vocab-size", "512",
        "--out", tmp_path / "tokens.bin", "--no-progress")  # fmt: skip
    run(ROOT / "data_prep/tokens_to_mds.py", tmp_path / "tokens.bin", "--seq-len", "32",
        "--val-rows", "16", "--out", tmp_path / "mds", "--no-progress")  # fmt: skip
    # A subprocess: the bench spawns its ep ranks, whose function runpy's module cannot pickle.
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = ["--data", tmp_path / "mds", "--batches", "3", "--batch", "4", "--d-model", "32",
            "--n-layers", "1", "--experts", "4", "--expert-hidden", "16", "--eps", "2",
            "--a2a-rows", "2"]  # fmt: skip
    done = subprocess.run([sys.executable, str(SCRIPT), *map(str, argv)], env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    # Both sides' counts: equal active parameters but the router's 32 x 4.
    dense = re.search(r"^\| dense \| ([\d,]+) \| ([\d,]+) \|", out, re.M)
    moe = re.search(r"^\| moe \| ([\d,]+) \| ([\d,]+) \|", out, re.M)
    count = lambda text: int(text.replace(",", ""))  # noqa: E731
    assert count(moe[2]) == count(dense[2]) + 32 * 4
    assert count(moe[1]) > count(moe[2])
    # ep 2 sends what its routing gives, near the planner's even split.
    ep2 = re.search(r"^\| 2 \| ([\d,]+) \| ([\d,]+) \| ([\d,]+) \| ([\d,]+) \| ([\d.]+) \|$",
                    out, re.M)  # fmt: skip
    assert ep2 and count(ep2[1]) > 0 and 0.2 < float(ep2[5]) < 2.0, out

"""bench/train_throughput.py: argument checks, all three CPU sides, and the GPU suite on CPU."""

import json
import runpy
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "train_throughput.py"
TINY = ["--model", "mpt-tiny", "--seq-len", "16", "--batch", "2", "--override",
        "model.d_model=32", "model.n_heads=2", "model.n_layers=1", "model.vocab_size=64",
        "model.max_seq_len=16"]  # fmt: skip


@pytest.fixture(scope="module")
def bench():
    return runpy.run_path(str(SCRIPT))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--shape", "mpt-tiny", "--model", "mpt-1b"], "either --shape or --model"),
        (["--model", "mpt-1b"], "--model needs --seq-len"),
        (["--sides", "ax"], "letters among a, b, c"),
        (["--rounds", "0"], "must be positive"),
        (["--gpu", "--shape", "mpt-tiny"], "--gpu takes --gpu-models"),
        (["--gpu", "--steps", "0"], "--steps and --batch must be positive"),
    ],
)
def test_bad_arguments_are_refused(bench, capsys, argv, message):
    with pytest.raises(SystemExit):
        bench["parse_args"](argv)
    assert message in capsys.readouterr().err


def test_gpu_defaults_are_the_issue_s_suite(bench):
    args = bench["parse_args"](["--gpu"])
    assert args.gpu_models == ["mpt-125m", "mpt-350m", "mpt-1b"] and args.compile == "both"
    assert args.device == "cuda" and bench["GPU_SEQ_LEN"] == 2048


@pytest.mark.slow
def test_three_sides_run_and_print_ratios(bench, capsys):
    argv = [*TINY, "--precision", "fp32", "--rounds", "1", "--steps-per-round", "1"]
    assert bench["main"](argv) == 0
    out = capsys.readouterr().out
    for line in ("trainer (a)", "transformers (b)", "ours bare (c)", "ours / transformers",
                 "trainer / bare loop"):  # fmt: skip
        assert line in out


def test_gpu_suite_runs_a_tiny_shape_on_cpu(bench, capsys, tmp_path):
    # sdpa only: flex has no CPU backward (it is refused on CPU, as its own test checks).
    argv = ["--gpu", "--device", "cpu", "--gpu-models", "mpt-tiny", "--seq-len", "16",
            "--batch", "2", "--steps", "1", "--warmup", "0", "--compile", "off",
            "--attn-impls", "sdpa", "--json-out", str(tmp_path / "rows.json")]  # fmt: skip
    assert bench["main"](argv) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("mpt-tiny"))
    assert row.split()[:4] == ["mpt-tiny", "sdpa", "off", "2"]
    assert "failed" not in out
    (rows,) = json.loads((tmp_path / "rows.json").read_text())  # the rows, as printed
    assert (rows["model"], rows["attn_impl"], rows["compile"], rows["batch"]) == (
        "mpt-tiny", "sdpa", False, 2)  # fmt: skip
    assert f"{rows['tokens_per_s']:12,.0f}" in row


def test_gpu_suite_refuses_fp8_off_gpu_in_one_line(bench):
    argv = ["--gpu", "--device", "cpu", "--gpu-models", "mpt-tiny", "--batch", "2",
            "--gpu-precisions", "amp_bf16", "amp_fp8"]  # fmt: skip
    with pytest.raises(SystemExit) as info:
        bench["main"](argv)
    message = str(info.value.code)
    assert message.startswith("--gpu-precisions amp_fp8: fp8 training needs a CUDA GPU")
    assert "\n" not in message


def test_gpu_suite_needs_a_batch_off_cuda(bench):
    with pytest.raises(SystemExit, match="--batch is required on cpu"):
        bench["main"](["--gpu", "--device", "cpu", "--gpu-models", "mpt-tiny", "--compile", "off"])

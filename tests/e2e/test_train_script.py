"""End to end: text -> tokens -> MDS -> scripts/train.py in a subprocess, with overrides."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # runs scripts in subprocesses; `make test-fast` skips it

ROOT = Path(__file__).resolve().parents[2]


def run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result


@pytest.fixture(scope="module")
def mds_dir(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("e2e")
    corpus = tmp / "corpus"
    corpus.mkdir()
    for i, path in enumerate(sorted((ROOT / "llmfoundry").rglob("*.py"))[:40]):
        (corpus / f"doc{i}.txt").write_text(path.read_text())
    run(
        str(ROOT / "data_prep/text_to_tokens.py"),
        str(corpus),
        "--train-tokenizer",
        "--vocab-size",
        "512",
        "--out",
        str(tmp / "tokens.bin"),
        "--no-progress",
        cwd=tmp,
    )
    run(
        str(ROOT / "data_prep/tokens_to_mds.py"),
        str(tmp / "tokens.bin"),
        "--seq-len",
        "32",
        "--val-rows",
        "16",
        "--out",
        str(tmp / "mds"),
        "--no-progress",
        cwd=tmp,
    )
    return tmp / "mds"


def test_train_script_with_overrides(mds_dir, tmp_path):
    run_dir = tmp_path / "run"
    result = run(
        str(ROOT / "scripts/train.py"),
        f"data.remote={mds_dir}",
        "model.d_model=32",
        "model.n_heads=2",
        "model.n_layers=2",
        "model.max_seq_len=32",
        "model.vocab_size=512",
        "global_train_batch_size=8",
        "device_train_microbatch_size=4",
        "max_duration=12ba",
        "eval_interval=6ba",
        "scheduler.t_warmup=2ba",
        "optimizer.lr=3e-3",
        "callbacks.generate.max_new_tokens=8",
        "algorithms=[gradient_clipping,random_token_replacement]",
        f"hydra.run.dir={run_dir}",
        f"save_folder={tmp_path / 'ckpt'}",
        cwd=tmp_path,
    )
    out = result.stdout
    first, last = map(
        float, re.search(r"eval/val/loss: first ([\d.]+) -> last ([\d.]+)", out).groups()
    )
    assert last < first
    assert "--- sample" in out
    assert "algorithms/replaced_fraction" in out
    # The run ends saying where it is and what to try next, with this run's paths.
    assert out.splitlines()[-6].startswith("run folder: run (train.log")
    assert "python scripts/generate.py ckpt --prompt 'def '  #" in out
    assert "python scripts/serve.py ckpt  #" in out
    assert "'algorithms=[gradient_clipping,random_token_replacement]' " in out  # resume repeats
    assert f"save_folder={tmp_path / 'ckpt'} " in out and " autoresume=true  #" in out
    assert (run_dir / ".hydra" / "config.yaml").is_file()
    # the run folder keeps the console's lines (not the progress bar, which is on stderr)
    log = (run_dir / "train.log").read_text()
    assert re.search(r"eval/val/loss: first [\d.]+ -> last [\d.]+", log)
    assert "saved checkpoint" in log and "--- sample" in log
    assert log.count("\n") <= out.count("\n")
    assert (tmp_path / "ckpt" / "latest").is_file()


def test_llama_trains_then_generates_and_evaluates(mds_dir, tmp_path, capsys):
    """The Llama family through scripts/train.py (model=llama-tiny), then generate.py and
    eval.py on its checkpoint, as an MPT run."""
    import json
    import runpy

    run(
        str(ROOT / "scripts/train.py"),
        "model=llama-tiny",
        f"data.remote={mds_dir}",
        "model.d_model=32",
        "model.n_heads=4",
        "model.n_layers=2",
        "model.max_seq_len=32",
        "model.vocab_size=512",
        "global_train_batch_size=4",
        "max_duration=2ba",
        "eval_interval=2ba",
        "scheduler.t_warmup=1ba",
        "callbacks.generate.max_new_tokens=4",
        f"hydra.run.dir={tmp_path / 'run'}",
        f"save_folder={tmp_path / 'ckpt'}",
        cwd=tmp_path,
    )
    ckpt = str(tmp_path / "ckpt")
    from llmfoundry.checkpoint.pretrained import load_pretrained
    from llmfoundry.models.llama import LlamaForCausalLM

    assert isinstance(load_pretrained(ckpt)[0], LlamaForCausalLM)
    scripts = {
        n: runpy.run_path(str(ROOT / f"scripts/{n}.py"), run_name=n) for n in ("generate", "eval")
    }
    assert (
        scripts["generate"]["main"](
            [ckpt, "--prompt", "def ", "--temperature", "0", "--max-new-tokens", "4"]
        )
        == 0
    )
    assert "--- prompt 'def ' (" in capsys.readouterr().out
    task = tmp_path / "mc.jsonl"
    task.write_text(
        "".join(
            json.dumps({"query": "import", "choices": [" os", " re"], "gold": i % 2}) + "\n"
            for i in range(2)
        )
    )
    out = tmp_path / "results.json"
    assert scripts["eval"]["main"]([ckpt, str(task), "--out", str(out)]) == 0
    assert json.loads(out.read_text())["tasks"]["mc"]["examples"] == 2


def test_a_mixture_of_experts_trains_and_logs_its_router_losses(mds_dir, tmp_path):
    """model=qwen3-moe-tiny through scripts/train.py: the router losses and the expert load are
    logged as metrics beside the loss, and the checkpoint loads back as the family's model."""
    result = run(
        str(ROOT / "scripts/train.py"),
        "model=qwen3-moe-tiny",
        f"data.remote={mds_dir}",
        "model.d_model=32",
        "model.n_layers=2",
        "model.n_experts=4",
        "model.top_k=2",
        "model.expert_hidden=32",
        "model.z_loss_weight=0.001",
        "model.max_seq_len=32",
        "model.vocab_size=512",
        "global_train_batch_size=4",
        "max_duration=2ba",
        "eval_interval=2ba",
        "scheduler.t_warmup=1ba",
        "callbacks.generate.max_new_tokens=4",
        f"hydra.run.dir={tmp_path / 'run'}",
        f"save_folder={tmp_path / 'ckpt'}",
        cwd=tmp_path,
    )
    for metric in ("moe_aux_loss", "moe_z_loss", "moe_load_imbalance"):
        value = re.search(rf"train/{metric} ([\d.e+-]+)", result.stdout)
        assert value and float(value[1]) > 0, f"train/{metric} not logged:\n{result.stdout}"
    from llmfoundry.checkpoint.pretrained import load_pretrained
    from llmfoundry.models.qwen3_moe import Qwen3MoeForCausalLM

    assert isinstance(load_pretrained(str(tmp_path / "ckpt"))[0], Qwen3MoeForCausalLM)

"""lm-evaluation-harness in process (llmfoundry/harness.py): the same numbers as lm-eval's own
transformers model (HFLM) on the exported folder, found by name from lm-eval's command line,
bad settings refused in one line. The server path: tests/serving/test_server.py."""

from __future__ import annotations

import inspect
import json
import os
import re
import shlex
import subprocess
import sys
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest
import torch

from llmfoundry.checkpoint.pretrained import save_weights
from llmfoundry.models.mpt import MPTConfig, MPTForCausalLM
from llmfoundry.models.mpt.hf import export_to_hf
from llmfoundry.tokenizers.tokenizer import EOS_TOKEN, prepare_tokenizer, train_bpe
from llmfoundry.utils.errors import UserError
from tests.eval import lm_eval_parity as parity
from tests.serving.conftest import TEXTS  # the served model's: one tokenizer corpus

pytest.importorskip("lm_eval")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """A tiny MPT checkpoint with its tokenizer (ckpt/), its transformers export (hf/) and the
    local tasks (tasks/). EOS is never the greedy pick (its embedding row is zero, the tied
    logit 0 among spread ones), so generations run to a stop string or their length."""
    tmp = tmp_path_factory.mktemp("harness")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    train_bpe(TEXTS, vocab_size=300).save(str(tmp / "tokenizer.json"))
    tokenizer = prepare_tokenizer(tmp / "tokenizer.json")
    torch.manual_seed(0)
    config = MPTConfig(
        d_model=64, n_heads=2, n_layers=2, max_seq_len=64, vocab_size=tokenizer.vocab_size
    )
    model = MPTForCausalLM(config)
    with torch.no_grad():
        model.transformer.wte.weight[tokenizer.eos_id] = 0
    save_weights(model, str(tmp / "ckpt"), tmp / "tokenizer.json", run_name="tiny")
    export_to_hf(model, tmp / "hf", tokenizer=tokenizer.tokenizer, eos_token=EOS_TOKEN)
    parity.check_prompts_fit(tokenizer.encode)
    parity.write_tasks(tmp)
    return tmp


def test_in_process_equals_hflm_on_the_exported_folder(tiny, monkeypatch):
    """Multiple choice (loglikelihood), rolling perplexity and generate_until: each sample's
    responses and each metric equal HFLM's on the transformers export (log-likelihoods to 1e-5,
    accuracy and generated text exactly). Ours is asked for by name and model_args, as lm-eval's
    command line asks."""
    pytest.importorskip("accelerate")  # HFLM's
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tiny / "datasets"))
    parity.skip_environment_report(monkeypatch)
    from lm_eval.models.huggingface import HFLM

    from llmfoundry.harness import register

    register()
    ours = parity.evaluate(
        "llmfoundry", tiny / "tasks", f"checkpoint={tiny / 'ckpt'},max_seq_len={parity.MAX_LEN}"
    )
    hf = HFLM(pretrained=str(tiny / "hf"), max_length=parity.MAX_LEN, batch_size=1, device="cpu")
    parity.assert_same(ours, parity.evaluate(hf, tiny / "tasks"))


def cli_args(tiny: Path, model_args: str) -> list[str]:
    """lm-eval's command line for --model llmfoundry on two generation samples."""
    args = ["--model", "llmfoundry", "--model_args", f"checkpoint={tiny / 'ckpt'},{model_args}"]
    args += ["--tasks", "tiny_gen", "--include_path", str(tiny / "tasks"), "--limit", "2"]
    return [sys.executable, "-m", "llmfoundry.harness", *args]


@pytest.mark.slow  # lm-eval's command line indexes its thousands of task files first
def test_lm_eval_command_line_runs_model_llmfoundry(tiny):
    """lm-eval's own command line (`python -m llmfoundry.harness`: lm_eval's CLI with the model
    registered, while no lm-eval release discovers entry points) finds --model llmfoundry.
    (One run: each indexes lm-eval's task files; a bad model arg's one line is
    test_bad_settings_are_refused_in_one_line's.)"""
    env = {**os.environ, "HF_DATASETS_CACHE": str(tiny / "datasets"), "OMP_NUM_THREADS": "1"}
    command = cli_args(tiny, f"max_seq_len={parity.MAX_LEN}")
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "|tiny_gen|" in done.stdout and "exact_match" in done.stdout


def test_the_declared_entry_point_is_what_lm_eval_registers(tiny):
    """pyproject.toml's lm_eval.models entry point (what lm-eval's plugin discovery, after
    0.4.13, registers) resolves through lm-eval's registry to the model."""
    from lm_eval.api.registry import Registry

    from llmfoundry.harness import FoundryLM

    tomllib = pytest.importorskip("tomllib")  # 3.11+
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    registry = Registry("model")
    for name, value in declared["lm_eval.models"].items():
        registry.register(name, target=EntryPoint(name, value, "lm_eval.models"))
    assert registry.get("llmfoundry") is FoundryLM


def test_bad_settings_are_refused_in_one_line(tiny):
    from lm_eval.api.instance import Instance

    from llmfoundry.harness import FoundryLM

    lm = FoundryLM(checkpoint=str(tiny / "ckpt"), max_seq_len=parity.MAX_LEN, device="cpu")
    tokenizer, model = lm.tokenizer, lm.model
    with pytest.raises(UserError, match=r"precision='fp64': choose one of"):
        FoundryLM(checkpoint=model, tokenizer=tokenizer, precision="fp64")
    with pytest.raises(UserError, match=r"batch_size='auto': give a positive whole number"):
        FoundryLM(checkpoint=model, tokenizer=tokenizer, batch_size="auto")
    with pytest.raises(UserError, match="tp=2 pp=1 cp=1 split the model over torchrun's"):
        FoundryLM(checkpoint=model, tokenizer=tokenizer, tp=2)
    with pytest.raises(UserError, match="tp=1 pp=1 cp=2 split the model over torchrun's"):
        FoundryLM(checkpoint=model, tokenizer=tokenizer, cp=2)
    with pytest.raises(UserError, match="device='gpu0': not a device"):
        FoundryLM(checkpoint=model, tokenizer=tokenizer, device="gpu0")
    with pytest.raises(UserError, match=r"unknown model_args \['dtype'\]: llmfoundry takes"):
        FoundryLM(checkpoint=model, tokenizer=tokenizer, dtype="bf16")
    with pytest.raises(UserError, match="no checkpoint: pass --model_args checkpoint=PATH"):
        FoundryLM(tokenizer=tokenizer)
    sampled = Instance("generate_until", {}, ("hello", {"do_sample": True}), 0)
    with pytest.raises(UserError, match="do_sample: true with temperature 0: give a temperature"):
        lm.generate_until([sampled])
    beams = Instance("generate_until", {}, ("hello", {"num_beams": 4}), 0)
    with pytest.raises(UserError, match=r"generation_kwargs \['num_beams'\] are not supported"):
        lm.generate_until([beams])


def test_the_readme_command_is_lm_eval_s_command_line(monkeypatch):
    """The README block parses with lm-eval's own parser, into model_args the model takes."""
    from lm_eval._cli import HarnessCLI

    from llmfoundry.harness import FoundryLM

    readme = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(python -m llmfoundry\.harness .*?)```", readme, re.S)[1]
    words = shlex.split(block.replace("\\\n", " "))
    assert words[:3] == ["python", "-m", "llmfoundry.harness"]
    monkeypatch.setattr(sys, "argv", ["lm_eval", *words[3:]])
    args = HarnessCLI().parse_args()
    assert args.model == "llmfoundry"
    assert set(args.model_args) <= set(inspect.signature(FoundryLM).parameters)


def test_sampled_generation_is_seeded_per_prompt(tiny):
    """do_sample with a temperature samples as `generation.generate` does with the seed model
    arg: the same text for a prompt whatever is batched with it, another seed another text."""
    from lm_eval.api.instance import Instance

    from llmfoundry.harness import FoundryLM
    from llmfoundry.models.generation import GenerationConfig, generate

    lm = FoundryLM(checkpoint=str(tiny / "ckpt"), max_seq_len=parity.MAX_LEN, device="cpu")
    settings = {"do_sample": True, "temperature": 1.0, "until": ["\n"], "max_gen_toks": 6}
    prompts = parity.PROMPTS[:3]
    requests = [Instance("generate_until", {}, (p, settings), i) for i, p in enumerate(prompts)]
    texts = lm.generate_until(requests)
    assert lm.generate_until(requests[1:2]) == texts[1:2]
    for prompt, text in zip(prompts, texts, strict=True):
        ids = torch.tensor([lm.tok_encode(prompt)])
        config = GenerationConfig(6, temperature=1.0, seed=1234, stop=("\n",))
        expected = generate(lm.model, ids, None, config, decode=lm.tokenizer.decode).texts[0]
        assert text == expected
    other = FoundryLM(checkpoint=lm.model, tokenizer=lm.tokenizer, seed=7, max_seq_len=16)
    assert other.generate_until(requests) != texts


@pytest.mark.slow  # two processes, each loading torch and lm-eval
@pytest.mark.parametrize("mesh", ["tp=2"])  # pp: the same MeshForward (test_mesh_eval.py)
def test_under_torchrun_the_split_model_scores_as_one_process(tiny, tmp_path, mesh):
    """Under torchrun the model is split (tensor parallel over two processes; pipeline
    parallelism is the same `MeshForward`, whose stages tests/distributed/test_mesh_eval.py and
    whose loading tests/eval/test_eval_on_mesh.py compare with one process), every rank runs
    every request, and LOCAL_RANK 0 reports the one-process numbers."""
    from llmfoundry.harness import FoundryLM

    one = FoundryLM(checkpoint=str(tiny / "ckpt"), max_seq_len=parity.MAX_LEN, device="cpu")
    expected = json.loads(json.dumps(parity.numbers(parity.evaluate(one, tiny / "tasks"))))
    out = tmp_path / "numbers.json"
    command = [sys.executable, str(ROOT / "scripts" / "torchrun.py"), "--standalone"]
    command += ["--nproc_per_node=2", str(ROOT / "tests" / "eval" / "harness_mesh_worker.py")]
    command += [str(tiny / "ckpt"), str(tiny / "tasks"), str(out), mesh]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env["HF_DATASETS_CACHE"] = str(tiny / "datasets")
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    parity.assert_same_numbers(json.loads(out.read_text()), expected)


def test_without_lm_eval_the_import_is_one_line_naming_the_fix(monkeypatch):
    import importlib

    from llmfoundry.utils.errors import MissingPackage

    monkeypatch.setitem(sys.modules, "lm_eval.api.model", None)  # as if not installed
    monkeypatch.delitem(sys.modules, "llmfoundry.harness", raising=False)
    with pytest.raises(MissingPackage, match=r"pip install 'lm_eval>=0\.4\.10'"):
        importlib.import_module("llmfoundry.harness")

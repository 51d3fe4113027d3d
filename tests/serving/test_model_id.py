"""The served model's id: the run that trained the checkpoint, not the folder `checkpoints`."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from llmfoundry.checkpoint.pretrained import read_pretrained, save_weights
from llmfoundry.models.mpt import MPTConfig, MPTForCausalLM

ROOT = Path(__file__).resolve().parents[2]


def serve_script():
    spec = importlib.util.spec_from_file_location("serve", ROOT / "scripts" / "serve.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_served_id_is_the_run_name_or_the_flag(tmp_path):
    serve = serve_script()
    torch.manual_seed(0)
    model = MPTForCausalLM(MPTConfig(d_model=16, n_heads=2, n_layers=1, vocab_size=40))
    run = str(tmp_path / "outputs" / "demo-1" / "checkpoints")  # a run's save folder
    save_weights(model, run, run_name="demo-1")
    loaded = read_pretrained(run)
    assert loaded.run_name == "demo-1"
    assert serve.served_model_name(serve.parse_args([run]), loaded.run_name) == "demo-1"
    flag = serve.parse_args([run, "--served-model-name", "mpt-demo"])
    assert serve.served_model_name(flag, loaded.run_name) == "mpt-demo"
    assert serve.parse_args([run, "--model-name", "x"]).served_model_name == "x"  # the old flag
    unnamed = str(tmp_path / "imported")  # a checkpoint that records no run: its folder's name
    save_weights(model, unnamed)
    name = serve.served_model_name(serve.parse_args([unnamed]), read_pretrained(unnamed).run_name)
    assert name == "imported"

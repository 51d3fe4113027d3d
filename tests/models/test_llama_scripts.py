"""The Llama family through the scripts: a tiny random transformers LlamaForCausalLM (saved with
save_pretrained) imports (round trip within 1e-5), trains from the printed overrides' config,
exports to a folder transformers loads without remote code, and greedy generate.py equals
transformers' generate token for token."""

import runpy
import shlex
from pathlib import Path

import pytest
import torch
import transformers
from hydra.utils import instantiate
from tokenizers import Tokenizer, models, pre_tokenizers

from llmfoundry.checkpoint import pretrained
from llmfoundry.config.preflight import compose_config
from llmfoundry.models.families import logits_relative_error
from llmfoundry.models.llama import LlamaForCausalLM

REPO = Path(__file__).resolve().parents[2]
EOS = 63


def script(name: str):
    return runpy.run_path(str(REPO / "scripts" / f"{name}.py"), run_name=name)["main"]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    """A random transformers Llama (GQA, untied head, Llama 3.1 RoPE scaling) and its tokenizer."""
    out = tmp_path_factory.mktemp("hf_llama")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        vocab_size=64,
        max_position_embeddings=64,
        rope_theta=10000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
        initializer_range=0.2,
        eos_token_id=EOS,
        bos_token_id=None,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(out)
    vocab = {f"w{i}": i for i in range(EOS)} | {"<|endoftext|>": EOS}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(out / "tokenizer.json"))
    return out


@pytest.fixture(scope="module")
def imported(hf_dir, tmp_path_factory) -> tuple[Path, str]:
    ckpt = tmp_path_factory.mktemp("imported")
    import io
    from contextlib import redirect_stdout

    printed = io.StringIO()
    with redirect_stdout(printed):
        assert script("import_hf")([str(hf_dir), str(ckpt)]) == 0
    return ckpt, printed.getvalue()


def test_import_round_trip_and_the_printed_overrides_build_that_model(hf_dir, imported):
    ckpt, printed = imported
    error = float(printed.split("relative error ")[1].split()[0])
    assert error <= 1e-5
    model, tokenizer = pretrained.load_pretrained(str(ckpt))
    assert isinstance(model, LlamaForCausalLM) and Path(tokenizer).is_file()
    command = printed.split("finetune it with: python scripts/train.py ")[1].splitlines()[0]
    overrides = shlex.split(command)
    assert "model=from_checkpoint" in overrides and f"load_path={ckpt}/ep0-ba0" in overrides
    composed = instantiate(compose_config(REPO / "conf", overrides).model)  # rope_scaling too
    assert composed == model.config


def test_export_loads_in_transformers_and_greedy_generate_matches(
    hf_dir, imported, tmp_path, capsys
):
    ckpt, _ = imported
    out = tmp_path / "export"
    assert script("export_hf")([str(ckpt), str(out)]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(hf) is transformers.LlamaForCausalLM
    assert not (out / "modeling_llama.py").exists()  # no remote code
    original = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    model, _ = pretrained.load_pretrained(str(out))
    assert logits_relative_error(model, hf_dir) <= 1e-5
    for a, b in zip(original.state_dict().values(), hf.state_dict().values(), strict=True):
        assert torch.equal(a, b)

    prompts = [[1, 2, 3, 4], [9, 8]]
    capsys.readouterr()
    argv = [str(ckpt), "--temperature", "0", "--max-new-tokens", "8"]
    for p in prompts:
        argv += ["--prompt", " ".join(f"w{t}" for t in p)]
    assert script("generate")(argv) == 0
    printed = capsys.readouterr().out
    tokenizer = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    for p in prompts:
        with torch.no_grad():
            theirs = original.generate(
                torch.tensor([p]), max_new_tokens=8, do_sample=False, eos_token_id=EOS
            )[0, len(p) :].tolist()
        prompt = " ".join(f"w{t}" for t in p)
        text = tokenizer.decode([t for t in theirs if t != EOS])
        assert f"--- prompt {prompt!r} " in printed
        assert len(theirs) > 1 and f"\n{prompt}{text}\n" in printed, (theirs, printed)

"""scripts/export_hf.py, import_hf.py and generate.py on a checkpoint a real (tiny) run saved
(exports of sharded checkpoints: tests/distributed/test_fsdp_checkpoints.py)."""

import functools
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open
from tokenizers import Tokenizer, models, pre_tokenizers

from llmfoundry.callbacks import CheckpointSaver
from llmfoundry.checkpoint import WEIGHTS_ONLY, pretrained
from llmfoundry.models.generation import GenerationConfig, generate, left_pad
from llmfoundry.models.hf_folder import logits_relative_error
from llmfoundry.models.mpt.hf import from_hf_config
from llmfoundry.optim import DecoupledAdamW
from llmfoundry.trainer import Trainer
from tests.trainer.conftest import tiny_model, token_batches

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
MODEL = dict(d_model=32, n_heads=2, n_layers=2, max_seq_len=16, vocab_size=64)


def script(name: str):
    """The `main` of scripts/<name>.py, called in this process."""
    return runpy.run_path(str(SCRIPTS / f"{name}.py"), run_name=name)["main"]


def trainer(tmp_path: Path, **kwargs) -> Trainer:
    return Trainer(
        model=tiny_model(**kwargs.pop("model", {})),
        optimizer=functools.partial(DecoupledAdamW, lr=1e-2),
        train_dataloader=token_batches(2, 2),
        max_duration="2ba",
        run_dir=tmp_path,
        **kwargs,
    )


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A checkpoint saved by a 2-batch run whose config names its model and tokenizer."""
    tmp = tmp_path_factory.mktemp("run")
    vocab = {f"w{i}": i for i in range(63)} | {"<|endoftext|>": 63}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp / "tokenizer.json"))
    config = {
        "model": {"_target_": "llmfoundry.models.mpt.MPTConfig", **MODEL},
        "tokenizer": str(tmp / "tokenizer.json"),
    }
    t = trainer(tmp, config=config, callbacks=[CheckpointSaver(str(tmp / "ckpt"), "2ba", 1)])
    t.fit()
    return tmp


def test_export_then_import_round_trip(run, tmp_path, capsys):
    model, tokenizer = pretrained.load_pretrained(str(run / "ckpt"))
    assert tokenizer == str(run / "tokenizer.json")
    out = tmp_path / "hf"
    assert script("export_hf")([str(run / "ckpt"), str(out)]) == 0
    assert "relative error" in capsys.readouterr().out
    hf = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(hf) is transformers.MptForCausalLM
    assert logits_relative_error(model, out) <= 1e-5
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok("w5 w17")["input_ids"] == [5, 17] and tok.eos_token_id == 63
    assert hf.generation_config.eos_token_id == 63

    ckpt = tmp_path / "imported"
    assert script("import_hf")([str(out), str(ckpt)]) == 0
    assert "model=from_checkpoint" in capsys.readouterr().out
    back, back_tokenizer = pretrained.load_pretrained(str(ckpt))
    assert back.config == model.config and Path(back_tokenizer).is_file()
    for (name, a), b in zip(model.state_dict().items(), back.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    # Finetuning starts from it with weights-only loading; anything more is refused clearly.
    t = trainer(tmp_path / "ft", load_path=str(ckpt), load_ignore_keys=WEIGHTS_ONLY)
    tuned = t.state.model.state_dict().values()
    for (name, a), b in zip(model.state_dict().items(), tuned, strict=True):
        assert torch.equal(a, b), name
    with pytest.raises(ValueError, match=r"has no optimizer.*weights only.*load_ignore_keys"):
        trainer(tmp_path / "ft2", load_path=str(ckpt))


def test_bf16_export(run, tmp_path):
    assert script("export_hf")([str(run / "ckpt"), str(tmp_path), "--dtype", "bf16"]) == 0
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        assert f.get_tensor("transformer.wte.weight").dtype == torch.bfloat16


def test_export_refuses_what_transformers_cannot_represent(tmp_path, capsys):
    config = {"model": {**MODEL, "kv_n_heads": 1}}
    t = trainer(
        tmp_path,
        model=dict(kv_n_heads=1),
        config=config,
        callbacks=[CheckpointSaver(str(tmp_path / "ckpt"), "2ba", 1)],
    )
    t.fit()
    with pytest.raises(SystemExit) as exited:  # one line, as for every user error
        script("export_hf")(
            [
                str(tmp_path / "ckpt"),
                str(tmp_path / "hf"),
                "--tokenizer",
                "x",
                "--layout",
                "transformers",
            ]
        )
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot export" in err and "kv_n_heads=1" in err


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(attn_config={"qk_ln": True}), "attn_config.qk_ln=True"),
        (dict(attn_config={"alibi_bias_max": 16}), "attn_config.alibi_bias_max=16"),
        (dict(no_bias=False), "no_bias=False"),
        (dict(tie_word_embeddings=False), "tie_word_embeddings=False"),
        (dict(layer_norm_epsilon=1e-6), "layer_norm_epsilon=1e-06"),
    ],
)
def test_import_refuses_what_we_cannot_represent(fields, message):
    hf = transformers.MptConfig(d_model=32, n_heads=2, n_layers=1, **fields)
    with pytest.raises(ValueError, match=f"cannot import.*{message}"):
        from_hf_config(hf)


def test_generate_script_from_checkpoint_and_hf_folder(run, tmp_path, capsys):
    assert script("export_hf")([str(run / "ckpt"), str(tmp_path)]) == 0
    capsys.readouterr()
    model, _ = pretrained.load_pretrained(str(run / "ckpt"))
    prompts = ["w1 w2 w3", "w9"]
    config = GenerationConfig(max_new_tokens=5, temperature=0, eos_token_id=63)
    expected = generate(model, *left_pad([[1, 2, 3], [9]]), config)
    for source in (run / "ckpt", tmp_path):
        argv = [str(source), "--temperature", "0", "--max-new-tokens", "5"]
        assert script("generate")([*argv, "--prompt", prompts[0], "--prompt", prompts[1]]) == 0
        printed = capsys.readouterr().out
        tokenizer = Tokenizer.from_file(str(run / "tokenizer.json"))
        for prompt, tokens, reason in zip(
            prompts, expected.tokens, expected.finish_reasons, strict=True
        ):
            text = tokenizer.decode([t for t in tokens if t != 63])
            assert f"--- prompt {prompt!r} ({reason}) ---\n{prompt}{text}\n" in printed
    argv = [str(run / "ckpt"), "--prompt", "w1", "--dtype", "bf16", "--top-p", "0.9", "--stop", "w"]
    assert script("generate")(argv) == 0
    assert "--- prompt 'w1' (stop) ---\nw1\n" in capsys.readouterr().out


def test_bad_input_is_one_line_error(tmp_path):
    result = subprocess.run(
        [sys.executable, str(SCRIPTS / "generate.py"), str(tmp_path / "nowhere"), "--prompt", "x"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.startswith("error: load_path") and result.stderr.count("\n") == 1

"""llm-foundry's own HF folders (convert_composer_to_hf.py's output, the mosaicml/mpt-* layout:
MPTForCausalLM with auto_map remote code) through `from_hf`, which import_hf.py, generate.py,
eval.py and serve.py read folders with: config.json read as JSON (transformers' MptConfig
refuses its values), none of the folder's code run, the weights from pytorch_model.bin (weights
only) or safetensors, learned positions as well as ALiBi."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer, models, pre_tokenizers

from llmfoundry.checkpoint.pretrained import load_pretrained, read_pretrained
from llmfoundry.models.generation import GenerationConfig, generate, left_pad
from llmfoundry.models.hf_lib import transformers
from llmfoundry.tokenizers.tokenizer import load_tokenizer
from llmfoundry.utils.errors import UserError
from tests.models.foundry_folder import random_model, remote_code_ran, write_foundry_folder
from tests.utils.test_entry_points import main_of, one_line_error

CASES = {
    # mpt-7b's shape: ALiBi, no biases; safetensors (what save_pretrained writes today).
    "alibi": (dict(alibi=True, no_bias=True), "model.safetensors"),
    # llm-foundry's defaults (its CPU YAMLs): learned positions, biases; convert_composer_to_hf's
    # pytorch_model.bin.
    "learned": (dict(alibi=False, no_bias=False), "pytorch_model.bin"),
    "gqa": (
        dict(alibi=False, no_bias=False, n_heads=4, kv_n_heads=2, qk_ln=True, clip_qkv=3.0)
        | dict(sliding_window=6, expansion_ratio=2, low_precision_layernorm=False),
        "pytorch_model.bin",
    ),
}
EOS = 63
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "foundry"  # the real llm-foundry's
DATA = Path(__file__).resolve().parent / "data"  # foundry-gqa: data/make_foundry_gqa.py


def _tokenizer() -> Tokenizer:
    vocab = {f"w{i}": i for i in range(EOS)} | {"<|endoftext|>": EOS}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return tokenizer


@pytest.fixture
def no_transformers_config(monkeypatch):
    """transformers' config and model classes may not read an llm-foundry folder."""

    def refuse(*args, **kwargs):
        raise AssertionError("transformers read the llm-foundry folder")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", refuse)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)


@pytest.mark.parametrize(
    "folder, reference",
    [
        (FIXTURES / "alibi" / "hf-ba4", FIXTURES / "alibi" / "reference-logits-ba4.safetensors"),
        (
            FIXTURES / "learned-pos" / "hf-ba4",
            FIXTURES / "learned-pos" / "reference-logits-ba4.safetensors",
        ),
        (DATA / "foundry-gqa", DATA / "foundry-gqa" / "reference-logits.safetensors"),
    ],
    ids=["alibi", "learned-pos", "gqa"],
)
def test_logits_equal_llm_foundrys_own(folder, reference, no_transformers_config):
    """The folders the real llm-foundry wrote, and its own model's fp32 logits on them."""
    model, tokenizer = load_pretrained(str(folder))
    expected = load_file(reference)
    with torch.no_grad():
        ours = model(expected["input_ids"])
    theirs = expected["logits"]
    assert float((ours - theirs).abs().max() / theirs.abs().max()) <= 1e-5
    assert tokenizer == (str(folder) if (folder / "tokenizer.json").is_file() else None)


@pytest.mark.parametrize(
    ("case", "refusal"),
    [
        ("gqa-rope", "config.json.attn_config.rope=True is not supported: our MPT has no rotary"),
        ("variants", "config.json.tie_word_embeddings=False is not supported"),
    ],
)
def test_what_we_lack_is_refused_in_one_line(case, refusal, tmp_path, capsys):
    folder = FIXTURES / case / "hf-ba4"
    err = one_line_error(capsys, main_of("scripts/import_hf.py"), [str(folder), str(tmp_path)])
    assert refusal in err


@pytest.mark.parametrize("case", CASES)
def test_folder_reads_as_the_model_it_holds(case, tmp_path, no_transformers_config):
    fields, weights = CASES[case]
    model = random_model(**fields)
    folder = write_foundry_folder(model, tmp_path / case, weights)
    loaded = read_pretrained(str(folder)).model
    assert loaded.config == model.config
    ids = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))
    assert not remote_code_ran(folder)


def test_sharded_weights_and_bf16(tmp_path):
    model = random_model(alibi=False, no_bias=False)
    folder = write_foundry_folder(model, tmp_path / "f")
    state = torch.load(folder / "pytorch_model.bin", weights_only=True)
    (folder / "pytorch_model.bin").unlink()
    names = sorted(state)
    shards = {
        "pytorch_model-00001-of-00002.bin": names[::2],
        "pytorch_model-00002-of-00002.bin": names[1::2],
    }
    for shard, keys in shards.items():
        torch.save({k: state[k].bfloat16() for k in keys}, folder / shard)
    weight_map = {k: shard for shard, keys in shards.items() for k in keys}
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    loaded, _ = load_pretrained(str(folder))
    for name, tensor in loaded.state_dict().items():
        assert tensor.dtype == torch.float32 and torch.equal(tensor, state[name].bfloat16().float())


def test_import_then_generate(tmp_path, capsys):
    """import_hf.py writes a checkpoint of llm-foundry's folder (round trip printed), and
    generate.py continues a prompt with it and the folder's tokenizer, as the folder's model
    does."""
    folder = FIXTURES / "learned-pos" / "hf-ba4"
    assert main_of("scripts/import_hf.py")([str(folder), str(tmp_path / "ckpt")]) == 0
    assert "round trip: logits relative error 0.00e+00" in capsys.readouterr().out
    prompt = "the cat"
    argv = [str(tmp_path / "ckpt"), "--temperature", "0", "--max-new-tokens", "6"]
    assert main_of("scripts/generate.py")([*argv, "--prompt", prompt]) == 0
    model, tokenizer_dir = load_pretrained(str(folder))
    tokenizer = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    eos = tokenizer.token_to_id("<|endoftext|>")
    config = GenerationConfig(max_new_tokens=6, temperature=0, eos_token_id=eos)
    expected = generate(model, *left_pad([tokenizer.encode(prompt).ids]), config)
    text = tokenizer.decode([t for t in expected.tokens[0] if t != eos])
    printed = capsys.readouterr().out
    assert f"--- prompt {prompt!r} ({expected.finish_reasons[0]}) ---\n{prompt}{text}\n" in printed


class _Payload:
    """Unpickling it would create a file: what a hostile pytorch_model.bin could do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def _edit_config(folder: Path, **attn) -> None:
    config = json.loads((folder / "config.json").read_text())
    config["attn_config"].update(attn)
    (folder / "config.json").write_text(json.dumps(config))


def _escaping_index(folder: Path) -> None:
    """Sharded weights whose index names a file outside the folder."""
    (folder / "pytorch_model.bin").unlink()
    (folder / "pytorch_model.bin.index.json").write_text('{"weight_map": {"a": "../x.bin"}}')


@pytest.mark.parametrize(
    ("damage", "expected"),
    [
        (
            lambda f: _edit_config(f, rope=True),
            "config.json.attn_config.rope=True is not supported",
        ),
        (lambda f: _edit_config(f, wat=1), "config.json.attn_config.wat=1: not a key"),
        (
            lambda f: torch.save({"x": _Payload(f / "pwned")}, f / "pytorch_model.bin"),
            "pickle holds objects other than tensors",
        ),
        (
            _escaping_index,
            "shard '../x.bin' is not a file name of the folder",
        ),
        (
            lambda f: torch.save(
                {"transformer.wte.weight": torch.zeros(64, 32)}, f / "pytorch_model.bin"
            ),
            "the weights lack transformer.blocks.0",
        ),
    ],
    ids=["rope", "unknown-key", "pickle-payload", "index-escape", "missing-tensors"],
)
def test_refusals_are_one_line(damage, expected, tmp_path, capsys):
    folder = write_foundry_folder(random_model(alibi=False, no_bias=False), tmp_path / "hf")
    damage(folder)
    err = one_line_error(
        capsys, main_of("scripts/import_hf.py"), [str(folder), str(tmp_path / "o")]
    )
    assert expected in err
    assert not (folder / "pwned").exists() and not remote_code_ran(folder)


def test_a_tokenizer_that_is_the_folders_own_code_is_refused(tmp_path):
    """llm-foundry's tiktoken wrapper saves a tokenizer_config.json whose auto_map names code
    in the folder: refused in one line (transformers would ask on a terminal whether to run
    it), and the code does not run."""
    config = {"auto_map": {"AutoTokenizer": ["tiktoken.TiktokenTokenizerWrapper", None]}}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "tiktoken.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\n")
    with pytest.raises(UserError, match="llmfoundry never runs; give a tokenizer.json"):
        load_tokenizer(tmp_path)
    assert not (tmp_path / "ran").exists()

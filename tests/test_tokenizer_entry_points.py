"""generate.py, eval.py and the server read SentencePiece and tiktoken tokenizers through the
one loader (`prepare_tokenizer`): a tiny .model and a tiny .tiktoken file, made here, give the
same tokens and text through each entry point as the library does in-process."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

import pytest
import torch

from llmfoundry.checkpoint.ours import checkpoint_tokenizer
from llmfoundry.checkpoint.pretrained import save_weights
from llmfoundry.eval import evaluate_tasks, load_task
from llmfoundry.models.generation import GenerationConfig, generate, left_pad
from llmfoundry.models.mpt import MPTConfig, MPTForCausalLM
from llmfoundry.tokenizers.tokenizer import prepare_tokenizer
from llmfoundry.utils.errors import UserError
from tests.tokenizer_files import tiny_sentencepiece, tiny_tiktoken

REPO = Path(__file__).resolve().parents[1]
PROMPTS = ["the quick", "hello wörld"]


def script(name: str):
    return runpy.run_path(str(REPO / "scripts" / f"{name}.py"), run_name=name)["main"]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """Both tokenizer files and a weights-only checkpoint (no tokenizer of its own) of a model
    with rows for either vocabulary (320 pieces, 266 tiktoken ids)."""
    tmp = tmp_path_factory.mktemp("foreign")
    torch.manual_seed(0)
    model = MPTForCausalLM(
        MPTConfig(d_model=32, n_heads=2, n_layers=2, max_seq_len=64, vocab_size=320)
    )
    save_weights(model, str(tmp / "ckpt"))
    return {"model": tiny_sentencepiece(tmp), "tiktoken": tiny_tiktoken(tmp), "ckpt": tmp / "ckpt"}


@pytest.fixture(scope="module")
def model(files) -> MPTForCausalLM:
    from llmfoundry.checkpoint.pretrained import load_pretrained

    return load_pretrained(str(files["ckpt"]))[0]


def greedy(model, tokenizer, prompts, max_new_tokens=6) -> list[str]:
    ids, mask = left_pad([tokenizer.encode(p) for p in prompts])
    config = GenerationConfig(
        max_new_tokens=max_new_tokens, temperature=0.0, eos_token_id=tokenizer.eos_id
    )
    return generate(model, ids, mask, config, decode=tokenizer.decode).texts


@pytest.mark.parametrize("kind", ["model", "tiktoken"])
def test_generate_script(kind, files, model, capsys):
    spec = str(files[kind])
    argv = [str(files["ckpt"]), "--tokenizer", spec, "--temperature", "0", "--max-new-tokens", "6"]
    assert script("generate")([*argv, *(a for p in PROMPTS for a in ("--prompt", p))]) == 0
    printed = capsys.readouterr().out
    for prompt, text in zip(PROMPTS, greedy(model, prepare_tokenizer(spec), PROMPTS), strict=True):
        assert f"---\n{prompt}{text}\n" in printed


@pytest.mark.parametrize("kind", ["model", "tiktoken"])
def test_eval_script(kind, files, model, tmp_path, capsys):
    spec = str(files[kind])
    task = tmp_path / "mc.jsonl"
    rows = [
        {"query": "the quick", "choices": [" brown fox", " lazy dog"], "gold": i % 2}
        for i in range(4)
    ]
    task.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "eval.json"
    assert (
        script("eval")([str(files["ckpt"]), str(task), "--tokenizer", spec, "--out", str(out)]) == 0
    )
    want = evaluate_tasks(model, prepare_tokenizer(spec, require_eos=False), [load_task(str(task))])
    got = json.loads(out.read_text())["tasks"]
    got = {name: {k: v for k, v in r.items() if k != "ci95"} for name, r in got.items()}
    assert got == json.loads(json.dumps(want))


@pytest.mark.parametrize("kind", ["model", "tiktoken"])
def test_server_completions(kind, files, model, tmp_path):
    pytest.importorskip("fastapi")
    from starlette.testclient import TestClient

    from llmfoundry.serving.app import Limits, create_app
    from llmfoundry.serving.engine import Engine
    from llmfoundry.serving.tokenizer import load_served_tokenizer

    tokenizer = load_served_tokenizer(str(files[kind]))
    engine = Engine(model, tokenizer.decode, max_rows=2, max_len=64)
    app = create_app(engine, tokenizer, "tiny", Limits(max_prompt_tokens=32, max_tokens=8), 64)
    with TestClient(app, raise_server_exceptions=False) as client:
        body = {"prompt": PROMPTS, "max_tokens": 6, "temperature": 0}
        response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    texts = [choice["text"] for choice in response.json()["choices"]]
    assert texts == greedy(model, tokenizer.prepared, PROMPTS)
    (tmp_path / "chat.jinja").write_text("{{ messages }}")
    with pytest.raises(UserError, match="a chat template needs a tokenizer.json tokenizer"):
        load_served_tokenizer(str(files[kind]), chat_template=tmp_path / "chat.jinja")


def test_a_run_trained_with_a_tiktoken_name_finds_it(files):
    state = {"config": {"tokenizer": "tiktoken:cl100k_base"}}
    assert checkpoint_tokenizer(str(files["ckpt"]), state) == "tiktoken:cl100k_base"


def test_export_refuses_what_transformers_cannot_load_in_one_line(files, tmp_path, capsys):
    argv = [str(files["ckpt"]), str(tmp_path / "hf"), "--tokenizer", str(files["model"])]
    with pytest.raises(SystemExit) as exit_:
        script("export_hf")(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1
    assert "is a SentencePieceTokenizer; convert it to a transformers tokenizer folder" in err

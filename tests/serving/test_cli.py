"""scripts/serve.py and scripts/generate.py: a wrong path or option is one line and exit 2,
before any model is loaded where it can be; --debug shows the traceback instead."""

from __future__ import annotations

import runpy

import pytest

from tests.serving.conftest import ROOT


def script(name: str):
    return runpy.run_path(str(ROOT / "scripts" / f"{name}.py"), run_name=name)["main"]


def one_line_error(name: str, argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_:
        script(name)(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err


@pytest.fixture
def no_key(monkeypatch):
    monkeypatch.delenv("LLMFOUNDRY_API_KEY", raising=False)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["{tmp}/nowhere", "--prompt", "x"], "is neither a checkpoint folder"),
        (["{ckpt}", "--prompt", "x", "--device", "nodev"], "--device='nodev' is not a device"),
        (["{ckpt}", "--prompt", "x", "--device", "cuda:99"], "--device='cuda:99' but"),
        (["{ckpt}", "--prompts-file", "{tmp}/none.txt"], "cannot read --prompts-file"),
        (["{ckpt}", "--prompts-file", "{tmp}/latin1.txt"], "latin1.txt is not UTF-8 text"),
        (["{ckpt}"], "no prompts: pass --prompt"),
        (["{ckpt}", "--prompt", "x", "--tokenizer", "{tmp}/no.json"], "tokenizer"),
    ],
)
def test_generate_user_errors(argv, message, served_model, tmp_path, capsys):
    (tmp_path / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    fill = {"tmp": str(tmp_path), "ckpt": str(served_model / "ckpt")}
    assert message in one_line_error("generate", [a.format(**fill) for a in argv], capsys)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["{tmp}/nowhere"], "is neither a checkpoint folder"),
        (["{ckpt}", "--chat-template", "{tmp}/none.jinja"], "cannot read chat template"),
        (["{ckpt}", "--chat-template", "{tmp}/bad.jinja"], "does not parse: "),
        (["{ckpt}", "--device", "cuda:99"], "--device='cuda:99' but"),
        (["{ckpt}", "--eos-token", "NOPE"], "'NOPE' is not in the tokenizer's vocabulary"),
    ],
)
def test_serve_user_errors(argv, message, served_model, tmp_path, capsys, no_key):
    (tmp_path / "bad.jinja").write_text("{% if messages %}")
    fill = {"tmp": str(tmp_path), "ckpt": str(served_model / "ckpt")}
    assert message in one_line_error("serve", [a.format(**fill) for a in argv], capsys)


@pytest.mark.parametrize("flag", ["--max-concurrent=0", "--port=99999", "--log-level=loud"])
def test_serve_refuses_bad_options_before_loading(flag, tmp_path, capsys, no_key):
    with pytest.raises(SystemExit) as exit_:
        script("serve")([str(tmp_path / "nowhere"), flag])
    assert exit_.value.code == 2 and flag.split("=")[0] in capsys.readouterr().err


def test_debug_shows_the_traceback(tmp_path, no_key):
    for name, extra in (("generate", ["--prompt", "x"]), ("serve", [])):
        with pytest.raises(FileNotFoundError, match="is neither a checkpoint folder"):
            script(name)([str(tmp_path / "nowhere"), *extra, "--debug"])

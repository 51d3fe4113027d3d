"""Every entry point reports a problem the user can fix the same way: one line on stderr, exit
status 2, and with ``--debug`` the exception itself (its traceback). Each script's ``main(argv)``
runs in this process; scripts/train.py, whose command line is Hydra's, is run as a user does in
tests/config/test_cli_errors.py."""

from __future__ import annotations

import ast
import builtins
import dataclasses
import json
import runpy
from pathlib import Path

import pytest
from transformers import MptConfig

from llmfoundry.checkpoint.pretrained import read_pretrained, save_weights
from llmfoundry.models.mpt import MPTConfig, MPTForCausalLM
from llmfoundry.models.mpt.hf import from_hf_config
from llmfoundry.utils.errors import UserError

ROOT = Path(__file__).resolve().parents[2]
ENTRY_DIRS = ("scripts", "data_prep")
# Entry points whose errors are checked elsewhere (a Hydra command line: no in-process main).
ELSEWHERE = {
    "scripts/train.py": "tests/config/test_cli_errors.py",
    # torchrun's arguments (its parser); its workers' one-line errors are train.py's
    "scripts/torchrun.py": "tests/distributed/test_launch.py",
}


def main_of(script: str):
    """The ``main`` of `script` (a path under the repository), loaded without running it."""
    return runpy.run_path(str(ROOT / script), run_name=Path(script).stem)["main"]


def one_line_error(capsys, main, argv: list[str], prefix: str = "error: ") -> str:
    """Run ``main(argv)``: it must exit 2 with one stderr line starting with `prefix`."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        main(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2, err
    assert err.count("\n") == 1 and err.startswith(prefix) and "Traceback" not in err, err
    return err.strip()


def _cases(tmp: Path) -> dict[str, tuple[list[str], str]]:
    """Per entry point: a command line with a representative user error, and a piece of the
    line that names it."""
    nowhere = str(tmp / "nowhere")
    return {
        "scripts/convert_checkpoint.py": ([nowhere, str(tmp / "o.safetensors")], nowhere),
        "scripts/deploy.py": (["render", "conf/deploy/demo.yaml", "replicas"], "key=value"),
        "scripts/eval.py": ([nowhere, str(tmp / "task.jsonl")], nowhere),
        "scripts/eval_passkey.py": ([nowhere, "--data", nowhere], "data_prep/passkey.py"),
        "scripts/export_hf.py": ([nowhere, str(tmp / "out")], nowhere),
        "scripts/from_foundry.py": ([f"{nowhere}.yaml"], "give an llm-foundry train YAML"),
        "scripts/generate.py": ([nowhere, "--prompt", "x"], nowhere),
        "scripts/import_hf.py": ([nowhere, str(tmp / "out")], "not a transformers model folder"),
        "scripts/launch.py": (["render", "local", f"{nowhere}.yaml"], "no job file"),
        "scripts/plan.py": (["model=nosuch"], "model: no option 'nosuch'"),
        "scripts/plot.py": ([nowhere], "no metrics file"),
        "scripts/runs.py": ([nowhere], "does not exist"),
        "scripts/serve.py": ([nowhere], nowhere),
        "scripts/sweep_report.py": ([nowhere], "no trials"),
        "data_prep/docstring_task.py": (
            [nowhere, "--tokenizer", f"{nowhere}.json", "--out", str(tmp / "t.jsonl")],
            "not found",
        ),
        "data_prep/instructions_to_mds.py": (
            [f"{nowhere}.jsonl", "--out", str(tmp / "o"), "--tokenizer", f"{nowhere}.json"]
            + ["--seq-len", "8"],
            "nowhere",
        ),
        "data_prep/mds_tools.py": (["verify", nowhere], "no index.json"),
        "data_prep/passkey.py": (["--out", str(tmp / "pk"), "--seq-len", "4"], "seq_len=4"),
        "data_prep/text_to_tokens.py": (
            [nowhere, "--out", str(tmp / "t.bin"), "--tokenizer", f"{nowhere}.json"],
            "nowhere",
        ),
        "data_prep/tokens_to_mds.py": (
            [f"{nowhere}.bin", "--out", str(tmp / "m"), "--seq-len", "4"],
            "does not exist; write it with data_prep/text_to_tokens.py",
        ),
        "data_prep/adopt_tokens.py": (
            [f"{nowhere}.bin", "--dtype", "uint16", "--vocab-size", "10"],
            "does not exist",
        ),
    }


ENTRY_POINTS = sorted(_cases(Path("/tmp")))


def test_every_entry_point_has_a_case():
    found = {
        f"{folder}/{path.name}"
        for folder in ENTRY_DIRS
        for path in (ROOT / folder).glob("*.py")
        if "\nif __name__ == " in path.read_text()
    }
    assert found - set(ELSEWHERE) == set(ENTRY_POINTS)


@pytest.mark.parametrize("script", ENTRY_POINTS)
def test_user_error_is_one_line_and_debug_shows_it(script, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("LLMFOUNDRY_DEBUG", raising=False)
    monkeypatch.chdir(ROOT)  # conf/... paths as in the README
    argv, names = _cases(tmp_path)[script]
    prefix = "Job error: " if script == "scripts/launch.py" else "error: "
    main = main_of(script)
    assert names in one_line_error(capsys, main, argv, prefix)
    with pytest.raises(Exception) as raised:  # not SystemExit: the exception, traceback and all
        main([*argv, "--debug"])
    assert names in str(raised.value) or isinstance(raised.value, UserError)


def _more_cases(tmp: Path) -> list[tuple[str, list[str], str]]:
    """More user errors, in files and arguments, that no longer reach a script as a ValueError
    caught wholesale: each is a UserError where it is found."""
    (tmp / "bad.yaml").write_text("image: [")
    (tmp / "metrics.jsonl").write_text('garbage\n{"loss/train": 1}\n')
    (tmp / "t.txt").write_text("some text\n")
    hf = tmp / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 0}))
    return [
        ("scripts/deploy.py", ["render", str(tmp / "bad.yaml")], "YAML cannot read a value"),
        ("scripts/plot.py", [str(tmp / "metrics.jsonl")], "metrics.jsonl:1: not a JSON line"),
        ("scripts/serve.py", [str(hf)], "has no 'num_attention_heads'"),
        (
            "data_prep/passkey.py",
            ["--out", str(tmp / "pk"), "--seq-len", "64", "--train-rows", "0"],
            "one row",
        ),
        (
            "data_prep/text_to_tokens.py",
            [str(tmp / "t.txt"), "--out", str(tmp / "o.txt"), "--train-tokenizer"],
            "must end in .bin",
        ),
        ("data_prep/mds_tools.py", ["merge", str(tmp / "nowhere")], "does not exist"),
    ]


@pytest.mark.parametrize("case", range(6))
def test_more_user_errors_are_one_line(case, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("LLMFOUNDRY_DEBUG", raising=False)
    script, argv, names = _more_cases(tmp_path)[case]
    assert names in one_line_error(capsys, main_of(script), argv)


# Per entry point that once caught every ValueError and FileNotFoundError: the function its
# error block calls (a bug deep in the library raises through it) and the error the bug raises.
BUG_SITES = {
    "scripts/convert_checkpoint.py": (
        "llmfoundry.checkpoint.sharded.convert_to_safetensors",  # imported after parsing
        ValueError,
    ),
    "scripts/deploy.py": ("write", FileNotFoundError),
    "scripts/eval.py": ("run", ValueError),
    "scripts/eval_passkey.py": ("run", FileNotFoundError),
    "scripts/export_hf.py": ("export", ValueError),
    "scripts/generate.py": ("run", FileNotFoundError),
    "scripts/import_hf.py": ("run", ValueError),
    "scripts/plot.py": ("plot", FileNotFoundError),
    "scripts/runs.py": ("find_runs", FileNotFoundError),
    "scripts/serve.py": ("serve", ValueError),
    "scripts/sweep_report.py": ("report", FileNotFoundError),
    "data_prep/mds_tools.py": ("_verify", ValueError),
    "data_prep/tokens_to_mds.py": ("tokens_to_mds", FileExistsError),
    "data_prep/text_to_tokens.py": ("text_to_tokens", ImportError),
}


@pytest.mark.parametrize("script", sorted(BUG_SITES))
def test_a_bug_keeps_its_traceback(script, tmp_path, capsys, monkeypatch):
    """An internal error (a built-in exception, not a UserError) is not printed as the user's
    one-line mistake: it keeps its traceback."""
    monkeypatch.delenv("LLMFOUNDRY_DEBUG", raising=False)
    monkeypatch.chdir(ROOT)
    argv, _ = _cases(tmp_path)[script]
    main = main_of(script)
    site, bug = BUG_SITES[script]

    def broken(*args, **kwargs):
        raise bug("an internal invariant failed")

    if "." in site:
        monkeypatch.setattr(site, broken)
    else:
        monkeypatch.setitem(main.__globals__, site, broken)
    with pytest.raises(bug, match="an internal invariant failed"):
        main(argv)
    assert capsys.readouterr().err == ""


def _builtin_errors_in_also(path: Path) -> list[str]:
    """Built-in exception names given in an ``also=`` argument anywhere in the file at `path`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        for keyword in getattr(node, "keywords", []) if isinstance(node, ast.Call) else []:
            if keyword.arg != "also":
                continue
            for name in ast.walk(keyword.value):
                value = getattr(builtins, getattr(name, "id", ""), None)
                if isinstance(value, type) and issubclass(value, BaseException):
                    found.append(name.id)
    return found


def test_no_entry_point_reports_a_builtin_error_as_the_users():
    """The rule: code that knows the cause raises UserError; no script catches ValueError,
    FileNotFoundError & co. wholesale (that printed bugs as one line). `exit_on_user_error`
    refuses a built-in type in `also` when it runs; this finds one in the source."""
    offenders = {
        str(path.relative_to(ROOT)): names
        for folder in (*ENTRY_DIRS, "llmfoundry", "bench")
        for path in (ROOT / folder).rglob("*.py")
        if (names := _builtin_errors_in_also(path))
    }
    assert offenders == {}


def test_plan_names_a_misspelt_key_of_a_group(capsys):
    line = one_line_error(capsys, main_of("scripts/plan.py"), ["model.n_layer=2"])
    assert line.startswith("error: model.n_layer: unknown key; did you mean 'n_layers'?")


def test_import_hf_given_a_checkpoint_says_what_to_do_with_it(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    save_weights(MPTForCausalLM(MPTConfig(d_model=16, n_heads=2, n_layers=1)), str(ckpt))
    line = one_line_error(capsys, main_of("scripts/import_hf.py"), [str(ckpt), str(tmp_path / "o")])
    assert f"{ckpt} is a llmfoundry checkpoint" in line and "load_path=" in line


def test_a_transformers_folder_as_load_path_names_import_hf(tmp_path, capsys):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "mpt"}))
    argv = [str(hf), str(tmp_path / "o.safetensors")]
    line = one_line_error(capsys, main_of("scripts/convert_checkpoint.py"), argv)
    assert "is a transformers folder" in line and f"scripts/import_hf.py {hf} CKPT_DIR" in line


def test_a_refused_transformers_config_field_is_a_user_error():
    with pytest.raises(UserError, match="no_bias=False"):
        from_hf_config(MptConfig(d_model=16, n_heads=2, n_layers=1, no_bias=False))


def test_weights_that_do_not_fit_the_recorded_config_are_a_user_error(tmp_path):
    model = MPTForCausalLM(MPTConfig(d_model=16, n_heads=2, n_layers=1, vocab_size=32))
    model.config = dataclasses.replace(model.config, n_layers=2)  # what the checkpoint records
    save_weights(model, str(tmp_path / "ckpt"))
    with pytest.raises(UserError, match="its weights do not fit the model config it records"):
        read_pretrained(str(tmp_path / "ckpt"))

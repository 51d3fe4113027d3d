"""Every entry point reports a problem the user can fix the same way: one line on stderr, exit
status 2, and with ``--debug`` the exception itself (its traceback). Each script's ``main(argv)``
runs in this process; scripts/train.py, whose command line is Hydra's, is run as a user does in
tests/config/test_cli_errors.py."""

from __future__ import annotations

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
ELSEWHERE = {"scripts/train.py": "tests/config/test_cli_errors.py"}


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
            "text_to_tokens.py",
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

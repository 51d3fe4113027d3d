"""meta.json has one owner (llmfoundry/data/meta.py): the only code naming the file, reading it
with a size bound and a one-line error for a malformed one, and writing it whole."""

from __future__ import annotations

import ast
import json
import runpy
from pathlib import Path

import numpy as np
import pytest

from llmfoundry.data.meta import META_LIMIT, read_meta, write_meta
from llmfoundry.utils.errors import UserError

ROOT = Path(__file__).resolve().parents[2]
OWNER = ROOT / "llmfoundry" / "data" / "meta.py"


def _code_strings(path: Path) -> list[tuple[int, str]]:
    """(line, text) of the string constants of `path`'s code: not its docstrings."""
    tree = ast.parse(path.read_text(), filename=str(path))
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
        and id(node) not in docstrings
    ]  # fmt: skip


def test_only_the_meta_module_names_meta_json():
    """Readers and writers call llmfoundry/data/meta.py; none opens the file by name."""
    files = [p for d in ("llmfoundry", "data_prep", "scripts") for p in (ROOT / d).rglob("*.py")]
    naming = [
        f"{path.relative_to(ROOT)}:{line}"
        for path in files
        if path != OWNER
        for line, text in _code_strings(path)
        if "meta.json" in text
    ]
    assert naming == [], "name meta.json through llmfoundry.data.meta (META_FILE, read_meta, ...)"
    assert any("meta.json" in text for _, text in _code_strings(OWNER))


def test_read_meta_is_bounded_and_refuses_a_malformed_file_in_one_line(tmp_path):
    assert read_meta(str(tmp_path)) is None  # no meta.json: data not from data prep
    write_meta(str(tmp_path), {"vocab_size": 100, "tokenizer": None})
    assert read_meta(str(tmp_path)) == {"vocab_size": 100, "tokenizer": None}
    assert not [p.name for p in tmp_path.iterdir() if p.name != "meta.json"]  # no temp left
    for content, why in (
        (b'{"vocab_size": 1', "is not JSON"),
        (b"[1, 2]", "is not a JSON object"),
        (b"\xff\xfe", "is not JSON"),
        (b" " * (META_LIMIT + 1), "is larger than"),
    ):
        (tmp_path / "meta.json").write_bytes(content)
        with pytest.raises(UserError, match=why) as err:
            read_meta(str(tmp_path))
        assert "\n" not in str(err.value) and str(tmp_path / "meta.json") in str(err.value)


def script(name: str, *args: str) -> int:
    """data_prep/<name>.py's main in this process; its exit status (a user error: 2)."""
    try:
        return runpy.run_path(str(ROOT / "data_prep" / name), run_name="t")["main"](list(args))
    except SystemExit as exit:
        return exit.code


def test_a_malformed_meta_json_is_one_line_in_the_scripts(tmp_path, capsys):
    """tokens_to_mds.py rerun over a damaged meta.json: one line (--overwrite replaces it), and
    mds_tools.py verify the same, not a JSONDecodeError traceback."""
    bare = tmp_path / "train.bin"
    np.random.default_rng(0).integers(0, 100, 4096).astype(np.uint16).tofile(bare)
    out = tmp_path / "mds"
    convert = [str(bare), "--out", str(out), "--seq-len", "64", "--val-fraction", "0.1",
               "--dtype", "uint16", "--vocab-size", "100"]  # fmt: skip
    assert script("tokens_to_mds.py", *convert) == 0
    assert read_meta(str(out))["vocab_size"] == 100
    (out / "meta.json").write_text('{"format": "llmfoundry.mds-tokens", "seq_')  # cut short
    capsys.readouterr()
    assert script("tokens_to_mds.py", *convert) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "meta.json is not JSON" in err and "--overwrite" in err
    assert script("mds_tools.py", "verify", str(out)) == 2
    assert "meta.json is not JSON" in capsys.readouterr().err
    assert script("tokens_to_mds.py", *convert, "--overwrite") == 0
    assert json.loads((out / "meta.json").read_text())["seq_len"] == 64

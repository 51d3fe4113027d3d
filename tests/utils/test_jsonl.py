"""read_jsonl: the one .jsonl reader of instruction data and evaluation tasks."""

from __future__ import annotations

import fsspec
import pytest

from llmfoundry.utils.jsonl import read_jsonl


def test_objects_with_their_line_numbers_blank_lines_skipped(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text('{"a": 1}\n\n  \n{"b": "é"}\n', encoding="utf-8")
    assert list(read_jsonl(str(path))) == [
        (f"{path} line 1", {"a": 1}),
        (f"{path} line 4", {"b": "é"}),
    ]


def test_reads_fsspec_urls():
    fsspec.filesystem("memory").pipe("/jsonl/t.jsonl", b'{"x": [1, 2]}\n')
    assert list(read_jsonl("memory://jsonl/t.jsonl")) == [
        ("memory://jsonl/t.jsonl line 1", {"x": [1, 2]})
    ]


@pytest.mark.parametrize(
    ("line", "problem"),
    [('{"a": ', "line 2: invalid JSON"), ("[1, 2]", "line 2: expected a JSON object, got list")],
)
def test_bad_line_named(tmp_path, line, problem):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"ok": true}\n' + line + "\n")
    rows = read_jsonl(str(path))
    assert next(rows)[1] == {"ok": True}
    with pytest.raises(ValueError, match=problem):
        next(rows)

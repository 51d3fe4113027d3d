"""read_jsonl: the one .jsonl reader of instruction data and evaluation tasks."""

from __future__ import annotations

import tracemalloc

import fsspec
import pytest

from llmfoundry.utils.errors import UserError
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


def test_a_line_past_the_limit_is_refused_while_it_is_read(tmp_path):
    path = tmp_path / "huge.jsonl"
    path.write_bytes(b'{"ok": 1}\n{"prompt": "' + b"x" * (8 << 20) + b'"}\n')
    rows = read_jsonl(str(path), max_line_bytes=1 << 16)
    assert next(rows)[1] == {"ok": 1}
    tracemalloc.start()
    with pytest.raises(UserError, match=r"huge.jsonl line 2: longer than 65,536 bytes .* split"):
        next(rows)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 4 << 20  # a few chunks, never the 8 MB line


def test_a_long_last_line_without_newline_and_a_long_first_line(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_bytes(b'{"a": "' + b"y" * 3000 + b'"}')
    with pytest.raises(UserError, match="line 1: longer than 1,000 bytes"):
        list(read_jsonl(str(path), max_line_bytes=1000))
    assert len(list(read_jsonl(str(path), max_line_bytes=4000))) == 1


def test_a_line_that_is_not_utf8_is_named(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"ok": 1}\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(UserError, match=r"latin1.jsonl line 2: not UTF-8 \(byte 15 .*re-encode"):
        list(read_jsonl(str(path)))

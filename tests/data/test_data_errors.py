"""Bad data inputs give one-line errors naming the problem, the path and the fix (issue 13.11)."""

from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path

import pytest

from llmfoundry.data.prep import load_tokenizer, plan_tasks, read_task, text_to_tokens, train_bpe
from llmfoundry.data.streaming import StreamingDataset

REPO = Path(__file__).parents[2]


def one_line(err: pytest.ExceptionInfo) -> str:
    text = str(err.value)
    assert "\n" not in text, text
    return text


def test_missing_data_folder(tmp_path):
    with pytest.raises(FileNotFoundError) as err:
        StreamingDataset(str(tmp_path / "nope"), split="train")
    text = one_line(err)
    assert f"{tmp_path / 'nope'} does not exist" in text and "data_prep" in text


def test_folder_that_is_not_mds(tmp_path):
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "a.txt").write_text("hello")
    with pytest.raises(FileNotFoundError) as err:
        StreamingDataset(str(tmp_path / "texts"))
    text = one_line(err)
    assert f"{tmp_path / 'texts'} is not an MDS dataset" in text and "a.txt" in text
    (tmp_path / "texts" / "index.json").write_text("{not json")
    with pytest.raises(ValueError) as err:
        StreamingDataset(str(tmp_path / "texts"))
    text = one_line(err)
    assert "index.json" in text and "not valid JSON" in text and "rewrite" in text


def test_invalid_tokenizer_file(tmp_path):
    bad = tmp_path / "tokenizer.json"
    bad.write_text('{"model": 1}')
    with pytest.raises(ValueError) as err:
        load_tokenizer(bad)
    text = one_line(err)
    assert str(bad) in text and "not a valid tokenizer" in text


@pytest.fixture
def tokenizer_file(tmp_path) -> Path:
    path = tmp_path / "tok.json"
    train_bpe(["some text to learn from " * 20], 280).save(str(path))
    return path


def test_parquet_column_of_the_wrong_type(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"text": [1, 2, 3]}), path)
    with pytest.raises(ValueError) as err:
        plan_tasks([str(path)])
    text = one_line(err)
    assert str(path) in text and "'text'" in text and "int64" in text and "--text-field" in text


def test_non_utf8_jsonl(tmp_path, tokenizer_file):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(ValueError) as err:
        text_to_tokens([str(path)], tmp_path / "o" / "t.bin", tokenizer=tokenizer_file)
    text = one_line(err)
    assert str(path) in text and "UTF-8" in text and "byte 17" in text


def test_cli_exits_2_with_one_line(tmp_path, tokenizer_file, capsys):
    spec = importlib.util.spec_from_file_location("t2t", REPO / "data_prep" / "text_to_tokens.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"text": "caf\xe9"}\n')
    out = tmp_path / "o" / "t.bin"
    with pytest.raises(SystemExit) as exited:
        module.main([str(path), f"--tokenizer={tokenizer_file}", f"--out={out}", "--no-progress"])
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and str(path) in err[0]


def test_skipped_files_are_named(tmp_path, tokenizer_file, caplog):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "good.txt").write_text("hello there")
    (tmp_path / "docs" / "latin1.txt").write_bytes(b"caf\xe9")
    with caplog.at_level(logging.WARNING):
        meta = text_to_tokens(
            [str(tmp_path / "docs")], tmp_path / "o" / "t.bin", tokenizer=tokenizer_file
        )
    assert meta["skipped_documents"] == 1
    assert any(str(tmp_path / "docs" / "latin1.txt") in r.getMessage() for r in caplog.records)


def test_parquet_and_jsonl_treat_nulls_alike(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rows = ["a", None, "b"]
    pq.write_table(pa.table({"text": rows}), tmp_path / "d.parquet")
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": r}) + "\n" for r in rows))
    for name in ("d.parquet", "d.jsonl"):
        (task,) = plan_tasks([str(tmp_path / name)])
        assert read_task(task) == (["a", "b"], 1), name

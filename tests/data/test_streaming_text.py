"""StreamingTextDataset: MDS token rows as the trainer's batches (the builder: test_data_builder.py)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from llmfoundry.data import StreamingTextDataset
from llmfoundry.data.mds import MDSWriter
from llmfoundry.data.streaming import Stream

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO.parent / "shared" / "fixtures" / "mds"
L = 32


def token_rows(n: int, start: int = 0, length: int = L) -> np.ndarray:
    return ((np.arange(n)[:, None] + start) * 7 + np.arange(length)) % 50_000


def write_tokens(folder: Path, rows: np.ndarray, encoding: str = "uint16", **columns) -> None:
    spec = {"tokens": f"ndarray:{encoding}:{rows.shape[1]}"}
    spec.update({name: f"ndarray:{encoding}:{rows.shape[1]}" for name in columns})
    with MDSWriter(folder, spec, size_limit=1 << 12) as writer:
        for i, row in enumerate(rows):
            extra = {name: values[i].astype(encoding) for name, values in columns.items()}
            writer.write({"tokens": row.astype(encoding), **extra})


@pytest.fixture
def root(tmp_path: Path) -> Path:
    write_tokens(tmp_path / "mds" / "train", token_rows(100))
    write_tokens(tmp_path / "mds" / "val", token_rows(10, start=500))
    return tmp_path / "mds"


def test_samples_and_batches_are_long_tensors_of_the_rows(root: Path):
    ds = StreamingTextDataset(str(root), split="train", batch_size=4)
    rows = token_rows(100)
    sample = ds[42]
    assert sample["input_ids"].dtype == torch.int64 and sample["input_ids"].tolist() == list(
        rows[42]
    )
    ids = np.array([42, 3, 99, 57])  # rows from several shards, out of order
    batch = ds.get_batch(ids)
    assert batch["input_ids"].dtype == torch.int64 and batch["input_ids"].shape == (4, L)
    assert torch.equal(batch["input_ids"], torch.from_numpy(rows[ids]))
    assert torch.equal(batch["labels"], batch["input_ids"])
    batch["labels"][0, 0] = -100  # labels are a copy the trainer may mask
    assert batch["input_ids"][0, 0] == rows[42, 0]
    cut = StreamingTextDataset(str(root), split="train", max_seq_len=10)
    assert cut[1]["input_ids"].tolist() == list(rows[1, :10])
    assert torch.equal(cut.get_batch(ids)["input_ids"], torch.from_numpy(rows[ids, :10]))
    longer = StreamingTextDataset(str(root), split="train", max_seq_len=4 * L)
    assert longer.get_batch(ids)["input_ids"].shape == (4, L)  # shorter rows are not padded


def test_uint32_rows_and_sequence_ids(tmp_path: Path):
    rows = token_rows(20) + 70_000
    seq = np.repeat(np.arange(20)[:, None], L, axis=1) // 3
    write_tokens(tmp_path / "ds", rows, encoding="uint32", sequence_id=seq)
    ds = StreamingTextDataset(str(tmp_path / "ds"), batch_size=5)
    assert ds[3]["input_ids"].tolist() == list(rows[3])
    assert ds[3]["sequence_id"].tolist() == list(seq[3])
    batch = ds.get_batch(np.array([0, 19, 7]))
    assert torch.equal(batch["input_ids"], torch.from_numpy(rows[[0, 19, 7]]))
    assert torch.equal(batch["sequence_id"], torch.from_numpy(seq[[0, 19, 7]]))


def test_batches_across_shards_of_different_layouts(tmp_path: Path):
    write_tokens(tmp_path / "a", token_rows(20))
    write_tokens(tmp_path / "b", token_rows(20, start=100) + 70_000, encoding="uint32")
    write_tokens(tmp_path / "c", token_rows(20, start=200, length=2 * L))
    streams = [Stream(remote=str(tmp_path / name)) for name in "abc"]
    ds = StreamingTextDataset(streams=streams, max_seq_len=L, batch_size=6)
    rows = np.concatenate(
        [token_rows(20), token_rows(20, start=100) + 70_000, token_rows(20, 200, 2 * L)[:, :L]]
    )
    for ids in ([3, 25, 47, 0, 59, 21], [45, 2, 41, 19]):  # uint16 and uint32 rows; uint16 only
        batch = ds.get_batch(np.array(ids))
        assert torch.equal(batch["input_ids"], torch.from_numpy(rows[ids]))
        assert torch.equal(batch["labels"], batch["input_ids"])


def test_variable_length_rows_are_padded_with_ignored_labels(tmp_path: Path):
    rows = [np.arange(n, dtype=np.uint16) + 1 for n in (5, 9, 3, 9)]
    with MDSWriter(tmp_path / "var", {"tokens": "ndarray:uint16"}) as writer:
        for row in rows:
            writer.write({"tokens": row})
    ds = StreamingTextDataset(str(tmp_path / "var"), max_seq_len=8)
    batch = ds.get_batch(np.array([0, 1, 2]))
    assert batch["input_ids"].tolist() == [
        [1, 2, 3, 4, 5, 0, 0, 0],
        [1, 2, 3, 4, 5, 6, 7, 8],
        [1, 2, 3, 0, 0, 0, 0, 0],
    ]
    assert batch["labels"].tolist()[2] == [1, 2, 3, -100, -100, -100, -100, -100]
    assert (batch["labels"][1] == batch["input_ids"][1]).all()


def test_batches_are_padded_to_a_multiple_for_tensor_parallelism(tmp_path: Path):
    """Sequence parallelism splits every row over the tp ranks (the builder passes parallelism.tp):
    variable-length batches and fixed rows of another width are right-padded to a multiple,
    with ignored labels and the padding a document of its own."""
    rows = [np.arange(n, dtype=np.uint16) + 1 for n in (5, 3)]
    with MDSWriter(tmp_path / "var", {"tokens": "ndarray:uint16"}) as writer:
        for row in rows:
            writer.write({"tokens": row})
    ds = StreamingTextDataset(str(tmp_path / "var"), pad_to_multiple_of=4, sequence_id_from_eos=3)
    batch = ds.get_batch(np.array([0, 1]))
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4, 5, 0, 0, 0], [1, 2, 3, 0, 0, 0, 0, 0]]
    assert batch["labels"].tolist()[0] == [1, 2, 3, 4, 5, -100, -100, -100]
    assert batch["sequence_id"].tolist()[1][3:] == [-1] * 5
    write_tokens(tmp_path / "fixed", token_rows(2, length=6))
    fixed = StreamingTextDataset(str(tmp_path / "fixed"), pad_to_multiple_of=4)
    batch = fixed.get_batch(np.array([0, 1]))
    assert batch["input_ids"].shape == (2, 8) and batch["input_ids"][:, 6:].eq(0).all()
    assert batch["labels"][:, :6].equal(torch.from_numpy(token_rows(2, length=6).astype(np.int64)))
    assert batch["labels"][:, 6:].eq(-100).all()


def test_text_columns_are_required(tmp_path: Path):
    with MDSWriter(tmp_path / "txt", {"text": "str"}) as writer:
        writer.write({"text": "hello"})
    with pytest.raises(ValueError, match="no ndarray 'tokens' column"):
        StreamingTextDataset(str(tmp_path / "txt"))
    with MDSWriter(tmp_path / "float", {"tokens": "ndarray:float32:4"}) as writer:
        writer.write({"tokens": np.zeros(4, np.float32)})
    with pytest.raises(ValueError, match="holds float32"):
        StreamingTextDataset(str(tmp_path / "float"))


@pytest.mark.skipif(not FIXTURES.is_dir(), reason="shared MDS fixtures not present")
def test_reference_written_token_shards(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the default cache's parent
    expected = json.loads((FIXTURES / "expected.json").read_text())
    fixed = StreamingTextDataset(str(FIXTURES / "tokens_fixed"), batch_size=50)
    want = [s["tokens"]["ndarray"] for s in expected["tokens_fixed"]["samples"]]
    assert fixed.get_batch(np.arange(50))["input_ids"].tolist() == want
    # compressed, variable-length int32 rows: decompressed into a cache, padded per batch
    default = StreamingTextDataset(str(FIXTURES / "tokens_var_zstd"))  # default cache folder
    assert default.caches[0].local.is_relative_to(tmp_path)
    var = StreamingTextDataset(
        str(FIXTURES / "tokens_var_zstd"), str(tmp_path / "cache"), validate_hash="sha1"
    )
    want = [s["tokens"]["ndarray"] for s in expected["tokens_var_zstd"]["samples"]]
    assert [var[i]["input_ids"].tolist() for i in range(len(want))] == want
    batch = var.get_batch(np.arange(len(want)))
    for row, labels, tokens in zip(batch["input_ids"], batch["labels"], want, strict=True):
        assert row[: len(tokens)].tolist() == tokens and (labels[len(tokens) :] == -100).all()
    # a merged index (basenames with sub-folders) and its per-split indexes
    merged = StreamingTextDataset(str(FIXTURES / "splits"))
    train = StreamingTextDataset(str(FIXTURES / "splits"), split="train")
    assert merged.num_samples == 37 and train.num_samples == 30
    want = [s["tokens"]["ndarray"] for s in expected["splits/train"]["samples"]]
    assert [train[i]["input_ids"].tolist() for i in range(30)] == want
    assert [merged[i]["input_ids"].tolist() for i in range(30)] == want

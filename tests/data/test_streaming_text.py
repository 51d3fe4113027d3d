"""StreamingTextDataset, DataConfig and build_dataloader: the trainer's side of the data."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from llmfoundry.data import DataConfig, StreamingTextDataset, build_dataloader
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


def test_text_columns_are_required(tmp_path: Path):
    with MDSWriter(tmp_path / "txt", {"text": "str"}) as writer:
        writer.write({"text": "hello"})
    with pytest.raises(ValueError, match="no ndarray 'tokens' column"):
        StreamingTextDataset(str(tmp_path / "txt"))
    with MDSWriter(tmp_path / "float", {"tokens": "ndarray:float32:4"}) as writer:
        writer.write({"tokens": np.zeros(4, np.float32)})
    with pytest.raises(ValueError, match="holds float32"):
        StreamingTextDataset(str(tmp_path / "float"))


def config(**overrides) -> DataConfig:
    """DataConfig made the way the trainer makes it: Hydra instantiate of conf/data/mds.yaml."""
    node = OmegaConf.load(REPO / "conf" / "data" / "mds.yaml")
    node = OmegaConf.merge(node, OmegaConf.create(overrides))
    return instantiate(node)


def test_build_dataloader_for_train_and_eval(root: Path):
    cfg = config(remote=str(root))
    assert isinstance(cfg, DataConfig) and cfg.shuffle and cfg.eval_split == "val"
    train = build_dataloader(cfg, cfg.train_split, 8, 16)
    assert len(train) == 13
    train.set_epoch(0)
    batches = list(train)
    assert len(batches) == 13 and batches[0]["input_ids"].shape == (8, 16)
    assert batches[-1]["input_ids"].shape == (4, 16)
    seen = torch.cat([b["input_ids"][:, 0] for b in batches]).tolist()
    first_tokens = token_rows(100)[:, 0].tolist()
    assert sorted(seen) == sorted(first_tokens) and seen != first_tokens  # all, shuffled
    train.set_epoch(1)
    assert torch.cat([b["input_ids"][:, 0] for b in train]).tolist() != seen
    evaluation = build_dataloader(cfg, cfg.eval_split, 4, None)
    rows = torch.cat([b["input_ids"] for b in evaluation])
    assert torch.equal(rows, torch.from_numpy(token_rows(10, start=500)))  # in order, whole


def test_trainer_resumption_contract(root: Path):
    cfg = config(remote=str(root))
    loader = build_dataloader(cfg, "train", 8, None)
    loader.set_epoch(5)
    full = [b["input_ids"] for b in loader]
    state = loader.state_dict(num_samples=3 * 8)  # three steps of a global batch of 8
    assert json.loads(json.dumps(state)) == state  # plain data, fits any checkpoint
    fresh = build_dataloader(cfg, "train", 8, None)
    fresh.load_state_dict(state)
    fresh.set_epoch(5)
    rest = [b["input_ids"] for b in fresh]
    assert len(rest) == len(full) - 3 and all(
        torch.equal(a, b) for a, b in zip(rest, full[3:], strict=True)
    )
    fresh.set_epoch(6)
    assert len(list(fresh)) == len(full)


def test_streams_config(tmp_path: Path):
    write_tokens(tmp_path / "a" / "train", token_rows(40))
    write_tokens(tmp_path / "a" / "val", token_rows(4, start=900))
    write_tokens(tmp_path / "b" / "train", token_rows(10, start=1000))
    write_tokens(tmp_path / "b" / "val", token_rows(4, start=950))
    cfg = config(
        remote=None,
        epoch_size=60,
        streams={"a": {"remote": str(tmp_path / "a"), "proportion": 0.5},
                 "b": {"remote": str(tmp_path / "b"), "proportion": 0.5}},
    )  # fmt: skip
    train = build_dataloader(cfg, "train", 10, None)
    firsts = torch.cat([b["input_ids"][:, 0] for b in train])
    from_b = set(token_rows(10, start=1000)[:, 0].tolist())
    assert len(firsts) == 60 and sum(int(t) in from_b for t in firsts) == 30  # b up-sampled 3x
    val = build_dataloader(cfg, "val", 10, None)  # eval: each stream's split once
    assert sum(len(b["input_ids"]) for b in val) == 8


def test_config_errors_name_the_field(root: Path):
    with pytest.raises(ValueError, match="data.remote is required"):
        DataConfig()
    with pytest.raises(ValueError, match=r"data.streams.a: unknown key\(s\) \['split'\]"):
        DataConfig(streams={"a": {"remote": str(root), "split": "x"}})
    with pytest.raises(ValueError, match="prefetch_factor needs data.num_workers > 0"):
        DataConfig(remote=str(root), prefetch_factor=2)
    with pytest.raises(ValueError, match="data.validate_hash='sha'"):
        DataConfig(remote=str(root), validate_hash="sha")
    with pytest.raises(ValueError, match="data.cache_limit"):
        DataConfig(remote=str(root), cache_limit="lots")
    with pytest.raises(ValueError, match="data.num_workers must be an integer >= 0"):
        DataConfig(remote=str(root), num_workers=-1)
    with pytest.raises(ValueError, match="set data.remote or data.streams"):
        DataConfig(remote=str(root), streams={"a": {"remote": str(root)}})
    cfg = DataConfig(remote=str(root / "nope"))
    with pytest.raises(FileNotFoundError, match="data_prep"):
        build_dataloader(cfg, "train", 2, None)
    with pytest.raises(FileNotFoundError, match=r"available splits .*\['train', 'val'\]"):
        build_dataloader(DataConfig(remote=str(root)), "test", 2, None)


def test_dataloader_workers_match_the_main_process(root: Path):
    cfg0 = config(remote=str(root))
    cfg2 = config(remote=str(root), num_workers=2, prefetch_factor=2)
    a = [b["input_ids"] for b in build_dataloader(cfg0, "train", 6, None)]
    b = [b["input_ids"] for b in build_dataloader(cfg2, "train", 6, None)]
    assert len(a) == len(b) == 17 and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


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


def test_pin_memory_defaults_to_whether_cuda_is_there(root: Path, monkeypatch):
    for cuda in (False, True):
        monkeypatch.setattr(torch.cuda, "is_available", lambda cuda=cuda: cuda)
        assert DataConfig(remote=str(root)).pin_memory is cuda
    assert DataConfig(remote=str(root), pin_memory=False).pin_memory is False
    loader = build_dataloader(DataConfig(remote=str(root), pin_memory=False), "train", 2, None)
    assert loader.pin_memory is False

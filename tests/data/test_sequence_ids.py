"""Document ids from the eos token ending each document (data.sequence_id_from_eos)."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from llmfoundry.data.mds import MDSWriter
from llmfoundry.data.streaming import StreamingDataLoader
from llmfoundry.data.text import StreamingTextDataset, sequence_ids_from_eos

EOS = 3
REPO = Path(__file__).resolve().parents[2]


def test_eos_ends_its_own_document():
    ids = torch.tensor([[5, 6, EOS, 7, EOS, EOS, 8], [EOS, 9, 9, 9, 9, 9, 9]])
    assert sequence_ids_from_eos(ids, EOS).tolist() == [
        [0, 0, 0, 1, 1, 2, 3],
        [0, 1, 1, 1, 1, 1, 1],
    ]


def loader_of(root, batch_size, **kwargs) -> StreamingDataLoader:
    """The train split in storage order, as the trainer's loader."""
    dataset = StreamingTextDataset(str(root), split="train", batch_size=batch_size, **kwargs)
    return StreamingDataLoader(dataset)


def _dataset(root, rows, width=None):
    encoding = f"ndarray:uint16:{width}" if width else "ndarray:uint16"
    with MDSWriter(root / "train", {"tokens": encoding}) as writer:
        for row in rows:
            writer.write({"tokens": np.array(row, dtype=np.uint16)})
    (root / "meta.json").write_text(json.dumps({"eos_id": EOS}))


@pytest.mark.parametrize("option", ["auto", EOS])
def test_loader_adds_sequence_ids(tmp_path, option):
    rows = [[1, 2, EOS, 4, 5, EOS], [EOS, 1, 1, 1, EOS, 2]]
    _dataset(tmp_path, rows, width=6)
    loader = loader_of(tmp_path, 2, sequence_id_from_eos=option)
    loader.set_epoch(0)
    (batch,) = list(loader)
    assert batch["sequence_id"].tolist() == [[0, 0, 0, 1, 1, 1], [0, 1, 1, 1, 1, 2]]
    assert torch.equal(batch["input_ids"], torch.tensor(rows))


def test_padding_gets_its_own_id(tmp_path):
    _dataset(tmp_path, [[1, EOS, 2, 2], [1, 1]])  # variable length: the second row is padded
    loader = loader_of(tmp_path, 2, sequence_id_from_eos=EOS)
    loader.set_epoch(0)
    (batch,) = list(loader)
    assert batch["sequence_id"].tolist() == [[0, 0, 1, 1], [0, 0, -1, -1]]


def test_without_the_option_there_are_no_sequence_ids(tmp_path):
    _dataset(tmp_path, [[1, EOS, 2, 2]], width=4)
    loader = loader_of(tmp_path, 1)
    loader.set_epoch(0)
    assert "sequence_id" not in next(iter(loader))


def test_bad_values_are_named(tmp_path):
    _dataset(tmp_path, [[1, EOS, 2, 2]], width=4)
    with pytest.raises(ValueError, match="sequence_id_from_eos must be null, a token id or 'auto'"):
        loader_of(tmp_path, 1, sequence_id_from_eos="yes")
    (tmp_path / "meta.json").unlink()
    with pytest.raises(ValueError, match=r"meta.json was not found; give the eos token id"):
        loader_of(tmp_path, 1, sequence_id_from_eos="auto")
    (tmp_path / "meta.json").write_text("{}")
    with pytest.raises(ValueError, match=r"records no eos_id"):
        loader_of(tmp_path, 1, sequence_id_from_eos="auto")

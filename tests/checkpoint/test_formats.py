"""A load path is resolved once into the format that reads it (llmfoundry/checkpoint/formats.py),
and each format's files are read by its own reader: a mismatch is one line, not a traceback."""

import functools
from pathlib import Path

import pytest
import torch

from llmfoundry.checkpoint import CheckpointError, locate
from llmfoundry.checkpoint.formats import ComposerFormat, OurFormat
from llmfoundry.checkpoint.keys import FORMAT_VERSION
from llmfoundry.checkpoint.pretrained import read_pretrained
from llmfoundry.checkpoint.writer import write_checkpoint, write_object
from llmfoundry.optim import DecoupledAdamW
from llmfoundry.trainer import Trainer
from llmfoundry.utils.errors import UserError

from ..trainer.conftest import tiny_model, token_batches

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "foundry"
MODEL = {"_target_": "llmfoundry.models.mpt.MPTConfig", "d_model": 32, "n_heads": 2}
MODEL |= {"n_layers": 2, "max_seq_len": 16, "vocab_size": 64}


def test_a_load_path_is_located_once_into_its_format(tmp_path):
    composer = locate(str(FIXTURES / "alibi" / "ep0-ba4-rank0.pt"))
    assert isinstance(composer.format, ComposerFormat)
    assert isinstance(locate(str(FIXTURES / "sharded" / "ep0-ba4")).format, ComposerFormat)
    state = write_object({"format_version": FORMAT_VERSION, "config": {"model": MODEL}})
    write_checkpoint(str(tmp_path / "run"), "ep0-ba2", {"state.pt": state})
    ours = locate(str(tmp_path / "run"))  # a save folder: its checkpoint to continue from
    assert isinstance(ours.format, OurFormat) and ours.location == str(tmp_path / "run/ep0-ba2")
    assert ours.model_fields() == MODEL
    (tmp_path / "ep0-ba4-rank0.pt.tar.gz").write_bytes(b"\x1f\x8b not a zip")
    with pytest.raises(CheckpointError, match="is a file.*decompress"):
        locate(str(tmp_path / "ep0-ba4-rank0.pt.tar.gz"))


def deepspeed_sharded(folder: Path) -> Path:
    """A checkpoint whose sharded/ holds DeepSpeed's files (as strategy=deepspeed saves)."""

    def shards(path: Path) -> None:
        path.mkdir()
        torch.save({"module": {}}, path / "mp_rank_00_model_states.pt")

    state = write_object({"format_version": FORMAT_VERSION, "config": {"model": MODEL}})
    return Path(write_checkpoint(str(folder), "ep0-ba2", {"state.pt": state, "sharded": shards}))


def test_deepspeed_shards_are_named_where_only_deepspeed_reads_them(tmp_path):
    checkpoint = deepspeed_sharded(tmp_path / "ckpt")
    with pytest.raises(UserError, match="holds DeepSpeed's shards .* zero_to_fp32"):
        read_pretrained(str(checkpoint))  # generate, eval, serve, export_hf
    with pytest.raises(UserError, match="holds DeepSpeed's shards .* only strategy=deepspeed"):
        Trainer(
            model=tiny_model(),
            optimizer=functools.partial(DecoupledAdamW, lr=1e-2),
            train_dataloader=token_batches(2, 2),
            max_duration="2ba",
            run_dir=tmp_path,
            load_path=str(checkpoint),
        )

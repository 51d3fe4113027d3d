"""build_trainer from a composed config: several labelled evaluation sets."""

from pathlib import Path

import numpy as np
import pytest

from llmfoundry.build import build_trainer
from llmfoundry.config import ConfigError
from llmfoundry.config.preflight import check, compose_config
from llmfoundry.data.mds import MDSWriter

CONF = Path(__file__).resolve().parents[2] / "conf"
TINY = [
    "model.d_model=32", "model.n_heads=2", "model.n_layers=2", "model.max_seq_len=16",
    "model.vocab_size=64", "global_train_batch_size=4", "max_duration=2ba",
    "callbacks=[]", "loggers=[]", "save_folder=null",
]  # fmt: skip


def write_dataset(root: Path, offset: int) -> Path:
    for split, rows in (("train", 16), ("val", 8)):
        with MDSWriter(root / split, {"tokens": "ndarray:uint16:16"}) as writer:
            for i in range(rows):
                writer.write({"tokens": ((np.arange(16) * (i + offset)) % 64).astype(np.uint16)})
    return root


def test_several_labelled_eval_sets(tmp_path):
    main = write_dataset(tmp_path / "main", 1)
    other = write_dataset(tmp_path / "other", 7)
    overrides = [*TINY, f"data.remote={main}", f"data.eval_datasets={{code: '{other}'}}"]
    trainer = build_trainer(compose_config(CONF, overrides), tmp_path / "run")
    assert list(trainer.state.eval_dataloaders) == ["val", "code"]
    metrics = trainer.fit().eval_metrics
    assert {"eval/val/loss", "eval/code/loss", "eval/code/accuracy"} <= set(metrics)
    assert metrics["eval/val/loss"] != metrics["eval/code/loss"]


def test_eval_label_clash_is_a_config_error(tmp_path):
    main = write_dataset(tmp_path / "main", 1)
    with pytest.raises(ConfigError, match="label 'val' is taken"):
        check(CONF, [*TINY, f"data.remote={main}", f"data.eval_datasets={{val: '{main}'}}"])


def test_bits_per_byte_from_the_bytes_meta_json_records(tmp_path):
    """data_prep records each split's tokens and text bytes; eval reports bits per byte from
    them (loss / ln 2 / bytes per token), and leaves it out where meta.json has no record."""
    import json
    import math

    main = write_dataset(tmp_path / "main", 1)
    other = write_dataset(tmp_path / "other", 7)
    splits = {
        "train": {"tokens": 256, "text_bytes": 1024},
        "val": {"tokens": 128, "text_bytes": 448},
    }
    (main / "meta.json").write_text(json.dumps({"vocab_size": 64, "splits": splits}))
    overrides = [*TINY, f"data.remote={main}", f"data.eval_datasets={{code: '{other}'}}"]
    metrics = build_trainer(compose_config(CONF, overrides), tmp_path / "run").fit().eval_metrics
    assert metrics["eval/val/bits_per_byte"] == pytest.approx(
        metrics["eval/val/loss"] / math.log(2) / (448 / 128), rel=1e-12
    )
    assert "eval/code/bits_per_byte" not in metrics


def test_the_default_precision_is_resolved_once_for_the_strategys_device(tmp_path, caplog):
    """precision=auto (conf/train.yaml) is spelled out once, where the device is known: the
    converters and the trainer see the same precision, and the log says it once."""
    import logging

    main = write_dataset(tmp_path / "main", 1)
    overrides = [*TINY, f"data.remote={main}", "strategy.device=cpu"]
    with caplog.at_level(logging.INFO, logger="llmfoundry"):
        trainer = build_trainer(compose_config(CONF, overrides), tmp_path / "r")
    assert trainer.precision.name == "fp32"
    assert [m for m in caplog.messages if "precision=auto" in m] == ["precision=auto: fp32 on cpu"]

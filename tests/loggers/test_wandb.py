"""W&B in offline mode: the run folder gets the metrics and the config (without secrets)."""

import json
import struct
import sys

import pytest

from llmfoundry.loggers import WandBLogger
from tests.callbacks.conftest import make_trainer

wandb = pytest.importorskip("wandb")
from wandb.proto import wandb_internal_pb2  # noqa: E402


def read_records(path):
    """The protobuf records of a .wandb file: a 7-byte file header, then a LevelDB-style log of
    32 KiB blocks, each record a 7-byte header (crc32, length, type: 1 full, 2 first, 3 middle,
    4 last) and its payload; block tails too short for a header are zero padding."""
    data, block, pos = path.read_bytes(), 32768, 7
    records, pending = [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        payload = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 0:
            break
        pending = payload if kind in (1, 2) else pending + payload
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def test_offline_run_records_metrics_and_redacted_config(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_dir"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    config = {"run_name": "tiny-run", "optimizer": {"lr": 0.1}, "wandb_api_key": "abc123"}
    trainer = make_trainer(
        tmp_path / "run",
        n_batches=3,
        loggers=[WandBLogger(project="tests", tags=["ci"])],
        config=config,
    )
    trainer.fit()
    # run.finish() can return before W&B's service process has flushed the run file; teardown
    # waits for it, as the interpreter's exit does at the end of a training script.
    wandb.teardown()
    run_files = list((tmp_path / "wandb_dir" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(run_files) == 1
    records = read_records(run_files[0])
    history = {}
    for record in records:
        if record.WhichOneof("record_type") == "history":
            items = {
                item.key or "/".join(item.nested_key): json.loads(item.value_json)
                for item in record.history.item
            }
            if "loss/train" in items:
                history[record.history.step.num] = items["loss/train"]
    kinds = [record.WhichOneof("record_type") for record in records]
    assert sorted(history) == [1, 2, 3], (history, kinds)
    assert history[3] == pytest.approx(trainer.state.train_loss)
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert run.display_name == "tiny-run" and list(run.tags) == ["ci"]
    sent = {
        item.key: json.loads(item.value_json)
        for record in records
        if record.WhichOneof("record_type") == "config"
        for item in record.config.update
    }
    sent.update({item.key: json.loads(item.value_json) for item in run.config.update})
    assert sent["optimizer"] == {"lr": 0.1}
    assert "wandb_api_key" not in sent and "abc123" not in run_files[0].read_bytes().decode(
        "latin-1"
    )


def test_command_line_recorded_by_wandb_is_redacted(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_dir"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    argv = [
        "scripts/train.py",
        "+data.storage_options.secret=hunter3",
        "data.remote=s3://bob:hunter2@minio:9000/bucket/mds",
        "max_duration=3ba",
    ]
    monkeypatch.setattr("sys.argv", list(argv))
    trainer = make_trainer(
        tmp_path / "run", n_batches=1, loggers=[WandBLogger(project="tests")], config={}
    )
    trainer.fit()
    wandb.teardown()
    assert sys.argv == argv  # only what W&B records is redacted
    files = [p for p in (tmp_path / "wandb_dir").rglob("*") if p.is_file()]
    recorded = b"".join(p.read_bytes() for p in files)
    assert b"max_duration=3ba" in recorded  # the command line is recorded ...
    assert b"hunter2" not in recorded and b"hunter3" not in recorded  # ... without credentials

"""data=memmap: windows of a data_prep token file (data/memmap.py), with the loader contract."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from llmfoundry.build import build_trainer
from llmfoundry.config.preflight import compose_config
from llmfoundry.data import MemmapTokens
from llmfoundry.data.prep.text_to_tokens import text_to_tokens
from llmfoundry.data.streaming import StreamingDataLoader
from llmfoundry.utils.errors import MissingInput, UserError
from tests.checkpoint.helpers import read_steps

CONF = Path(__file__).resolve().parents[2] / "conf"
L = 16


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    """A real data_prep token stream: tokens.bin, tokens.json, tokenizer.json in one folder."""
    corpus = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "data", "token", "model", "window", "rank"]
    for i in range(12):
        text = " ".join(rng.choice(words, 300).tolist())
        (corpus / f"{i:02d}.txt").write_text(text + ".\n")
    out = tmp_path_factory.mktemp("data") / "tokens.bin"
    text_to_tokens([str(corpus)], out, train_tokenizer=True, vocab_size=300, progress=False)
    return out.parent


def tokens_of(folder: Path) -> np.ndarray:
    meta = json.loads((folder / "tokens.json").read_text())
    return np.fromfile(folder / "tokens.bin", dtype=meta["dtype"])


def dataset(folder: Path, split: str = "train", **kwargs) -> MemmapTokens:
    return MemmapTokens(str(folder), split, max_seq_len=L, **{"batch_size": 4, **kwargs})


def test_random_windows_are_seeded_rows_of_the_file(prepared: Path):
    tokens = tokens_of(prepared)
    ds = dataset(prepared, val_fraction=0.1)
    cut = len(tokens) - round(len(tokens) * 0.1)
    assert ds.num_tokens == cut and ds.epoch_size == cut // L == len(ds)
    assert ds.meta["vocab_size"] == json.loads((prepared / "tokens.json").read_text())["vocab_size"]
    batches = list(StreamingDataLoader(ds))
    starts = np.concatenate([ids for ids, _ in ds.batches()])
    assert starts.min() >= 0 and starts.max() <= cut - L  # inside the train split
    for batch, (ids, _) in zip(batches, ds.batches(), strict=True):
        want = torch.from_numpy(tokens[ids[:, None] + np.arange(L)].astype(np.int64))
        assert torch.equal(batch["input_ids"], want) and torch.equal(batch["labels"], want)
        assert "sample_mask" not in batch and "sequence_id" not in batch
    again = np.concatenate([ids for ids, _ in dataset(prepared, val_fraction=0.1).batches()])
    assert np.array_equal(starts, again)  # deterministic
    ds.set_epoch(1)
    assert not np.array_equal(starts, np.concatenate([ids for ids, _ in ds.batches()]))
    other = dataset(prepared, val_fraction=0.1, shuffle_seed=3)
    assert not np.array_equal(starts, np.concatenate([ids for ids, _ in other.batches()]))
    assert len(dataset(prepared, epoch_size=10)) == 10


def test_sequential_windows_and_the_val_tail(prepared: Path):
    n = len(tokens_of(prepared))
    train = dataset(prepared, windows="sequential", batch_size=5)
    cut = n - round(n * 0.02)
    assert np.array_equal(
        np.concatenate([ids for ids, _ in train.batches()]), np.arange(cut // L) * L
    )
    val = dataset(prepared, "val", windows="random", evaluation=True)  # eval: sequential
    assert val.windows == "sequential" and val.epoch_size == (n - cut) // L
    assert np.array_equal(
        np.concatenate([ids for ids, _ in val.batches()]), cut + np.arange((n - cut) // L) * L
    )
    whole = dataset(prepared, windows="sequential", val_fraction=None)
    assert whole.num_tokens == n


def test_an_eval_split_records_the_text_bytes_it_decodes_to(prepared: Path):
    from tokenizers import Tokenizer

    val = dataset(prepared, "val", val_fraction=0.3, evaluation=True)
    read = tokens_of(prepared)[val.lo : val.lo + val.epoch_size * L]
    text = Tokenizer.from_file(str(prepared / "tokenizer.json")).decode(read.tolist())
    assert val.meta["splits"] == {"val": {"tokens": len(read), "text_bytes": len(text.encode())}}
    assert "splits" not in dataset(prepared, "train").meta  # training reads random windows


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_eval_sample_mask_counts_every_window_once(prepared: Path, world_size: int):
    kept, read = Counter(), 0
    for rank in range(world_size):
        ds = dataset(
            prepared, "val", val_fraction=0.3, evaluation=True, data_parallel=(rank, world_size)
        )
        for (ids, _), batch in zip(ds.batches(), StreamingDataLoader(ds), strict=True):
            kept.update(ids[batch["sample_mask"].numpy()].tolist())
            read += len(ids)
    windows = ds.epoch_size
    assert windows % 3 and kept == Counter((ds.lo + np.arange(windows) * L).tolist())
    assert read == -(-windows // world_size) * world_size


def test_ranks_read_their_part_and_resume_exactly(prepared: Path):
    def global_order(world_size: int, state=None) -> list[int]:
        per_rank = []
        for rank in range(world_size):
            ds = dataset(prepared, batch_size=8 // world_size, data_parallel=(rank, world_size))
            ds.set_epoch(2)
            if state is not None:
                ds.load_state_dict(state)
                ds.set_epoch(2)
            per_rank.append([ids.tolist() for ids, _ in ds.batches()])
        return [i for step in zip(*per_rank, strict=True) for batch in step for i in batch]

    single = global_order(1)
    assert global_order(2)[: len(single)] == single  # the same global order on 2 ranks
    ds = dataset(prepared, batch_size=8)
    ds.set_epoch(2)
    state = ds.state_dict(num_samples=3 * 8)
    assert json.loads(json.dumps(state)) == state
    for world_size in (1, 2):  # the rest of the epoch, also on another world size
        assert global_order(world_size, state)[: len(single) - 24] == single[24:]
    with pytest.raises(ValueError, match="shuffle_seed: checkpoint 17 vs now 4"):
        dataset(prepared, shuffle_seed=4).load_state_dict(state)


def test_split_files_sequence_ids_and_workers(prepared: Path, tmp_path: Path):
    files = {"train": "tokens.bin", "val": "tokens.bin"}
    ds = dataset(prepared, "val", split_files=files, val_fraction=None, sequence_id_from_eos="auto")
    assert ds.num_tokens == len(tokens_of(prepared))
    eos = json.loads((prepared / "tokens.json").read_text())["eos_id"]
    assert ds.eos_id == eos
    batch = next(iter(StreamingDataLoader(ds)))
    ends = (batch["input_ids"] == eos).long()
    assert torch.equal(batch["sequence_id"], ends.cumsum(1) - ends)
    main = [b["input_ids"] for b in StreamingDataLoader(dataset(prepared))]
    two = [b["input_ids"] for b in StreamingDataLoader(dataset(prepared), num_workers=2)]
    assert len(main) == len(two) and all(torch.equal(a, b) for a, b in zip(main, two, strict=True))


def test_bad_input_is_a_one_line_error(prepared: Path, tmp_path: Path):
    with pytest.raises(MissingInput, match=r"tokens.bin does not exist; write it with data_prep"):
        dataset(tmp_path)
    with pytest.raises(UserError, match="fewer than one window of max_seq_len=100000"):
        MemmapTokens(str(prepared), max_seq_len=100_000)
    with pytest.raises(UserError, match="memmap data reads a local folder"):
        dataset("s3://bucket/data")
    with pytest.raises(UserError, match=r"max_seq_len=16 tokens, never padded: .*multiple of 3"):
        dataset(prepared, pad_to_multiple_of=3)
    assert dataset(prepared, pad_to_multiple_of=4).max_seq_len == L
    with pytest.raises(UserError, match="with val_fraction the splits are train and val"):
        dataset(prepared, "test")
    with pytest.raises(UserError, match="set val_fraction=null"):
        dataset(prepared, split_files={"train": "tokens.bin"})
    with pytest.raises(UserError, match=r"split 'val' is not in split_files"):
        dataset(prepared, "val", split_files={"train": "tokens.bin"}, val_fraction=None)
    with pytest.raises(UserError, match="epoch_size sets the number of random windows"):
        dataset(prepared, windows="sequential", epoch_size=5)
    with pytest.raises(UserError, match="windows must be 'random' or 'sequential'"):
        dataset(prepared, windows="shuffled")
    floats = tmp_path / "floats"
    floats.mkdir()
    np.arange(100, dtype=np.float32).tofile(floats / "tokens.bin")
    meta = json.loads((prepared / "tokens.json").read_text())
    meta.update(dtype="float32", num_tokens=100, tokens_file="tokens.bin")
    (floats / "tokens.json").write_text(json.dumps(meta))
    with pytest.raises(UserError, match="holds float32 tokens; memmap data reads uint16 or uint32"):
        dataset(floats)
    meta.update(dtype="uint32", num_tokens=1000)  # the sidecar does not describe the file
    (floats / "tokens.json").write_text(json.dumps(meta))
    with pytest.raises(UserError, match=r"tokens.bin is 400 bytes, sidecar says 4000"):
        dataset(floats)


def build(prepared: Path, tmp_path: Path, name: str, *overrides: str):
    vocab = json.loads((prepared / "tokens.json").read_text())["vocab_size"]
    cfg = compose_config(
        CONF,
        [
            "data=memmap", f"data.remote={prepared}", "data.val_fraction=0.1",
            "model.d_model=32", "model.n_heads=2", "model.n_layers=2",
            f"model.max_seq_len={L}", f"model.vocab_size={vocab}", "model.resid_pdrop=0.1",
            "global_train_batch_size=4", "max_duration=8ba", "scheduler.t_warmup=2ba",
            "eval_interval=4ba", "eval_first=false", "loggers=[]", "callbacks=[]",
            "+callbacks.steps._target_=tests.checkpoint.helpers.StepRecorder",
            f"+callbacks.steps.path={tmp_path / name / 'steps.jsonl'}",
            f"save_folder={tmp_path / name / 'ckpt'}", "save_interval=4ba", f"run_name={name}",
            *overrides,
        ],
    )  # fmt: skip
    return build_trainer(cfg, tmp_path / name)


def test_training_resumes_mid_epoch_like_a_straight_run(prepared: Path, tmp_path: Path):
    straight = build(prepared, tmp_path, "straight")
    assert straight.state.dataloader_len > 8  # batch 4 is mid-epoch
    metrics = straight.fit().eval_metrics
    assert "eval/val/loss" in metrics and "eval/val/bits_per_byte" in metrics
    resumed = build(
        prepared, tmp_path, "resumed", f"load_path={tmp_path / 'straight' / 'ckpt' / 'ep0-ba4'}"
    )
    assert resumed.state.timestamp.batch == 4
    resumed.fit()
    want = read_steps(tmp_path / "straight" / "steps.jsonl")
    got = read_steps(tmp_path / "resumed" / "steps.jsonl")
    assert [s["batch"] for s in got] == [5, 6, 7, 8]
    assert got == want[4:]  # the same samples and bit-identical losses
    assert len({i for s in want for i in s["ids"]}) > 4

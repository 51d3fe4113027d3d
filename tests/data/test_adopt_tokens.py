"""Token files made elsewhere (issue 33.1): a bare nanoGPT ``train.bin`` / ``val.bin`` pair (uint16,
no sidecar, no tokenizer) trains with data=memmap and converts to MDS, locally and on S3, given
its dtype and vocab_size, or after ``data_prep/adopt_tokens.py`` wrote its sidecar once; and a
user's own loop can put MemmapTokens in a torch DataLoader."""

from __future__ import annotations

import functools
import json
import logging
import os
import runpy
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from llmfoundry.build import build_trainer
from llmfoundry.config.preflight import compose_config
from llmfoundry.data import MemmapTokens
from llmfoundry.data.prep.adopt import adopt_tokens
from llmfoundry.trainer import Trainer
from llmfoundry.utils.errors import MissingInput, UserError
from tests.trainer.conftest import tiny_model

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "conf"
VOCAB, EOS, L = 100, 99, 16
FACTS = ["--dtype", "uint16", "--vocab-size", str(VOCAB), "--eos-id", str(EOS)]


@pytest.fixture
def nanogpt(tmp_path: Path) -> Path:
    """nanoGPT's layout: train.bin and val.bin of uint16 ids, documents ending in EOS."""
    folder = tmp_path / "owt"
    folder.mkdir()
    tokens = np.random.default_rng(0).integers(0, EOS, 4800).astype(np.uint16)
    tokens[39::40] = EOS
    tokens[:4000].tofile(folder / "train.bin")
    tokens[4000:].tofile(folder / "val.bin")
    return folder


def windows(folder: Path, split: str = "train", **kwargs) -> MemmapTokens:
    bare = {"dtype": "uint16", "vocab_size": VOCAB, "eos_id": EOS}
    return MemmapTokens(
        str(folder), split, split_files={"train": "train.bin", "val": "val.bin"},
        val_fraction=None, max_seq_len=L, **{**bare, **kwargs},
    )  # fmt: skip


def test_memmap_trains_on_a_bare_pair_given_its_dtype_and_vocab_size(
    nanogpt: Path, tmp_path, caplog
):
    """With the default callbacks: `generate` has no tokenizer to sample with (the data has
    none), so it says so once, how to get samples, and training goes on."""
    cfg = compose_config(
        CONF,
        [
            "data=memmap", f"data.remote={nanogpt}", "data.val_fraction=null",
            "data.split_files={train: train.bin, val: val.bin}", "data.dtype=uint16",
            f"data.vocab_size={VOCAB}", f"data.eos_id={EOS}", "data.sequence_id_from_eos=auto",
            "model.d_model=16", "model.n_heads=2", "model.n_layers=1", f"model.max_seq_len={L}",
            "model.vocab_size=128", "global_train_batch_size=4", "max_duration=2ba",
            "scheduler.t_warmup=1ba", "eval_interval=2ba", "eval_first=false",
            "eval_subset_num_batches=2", "loggers=[]", "save_folder=null",
        ],
    )  # fmt: skip
    assert "generate" in cfg.callbacks
    with caplog.at_level(logging.WARNING, logger="llmfoundry"):
        trainer = build_trainer(cfg, tmp_path / "run")
    skipped = [r.getMessage() for r in caplog.records if "generate: no samples" in r.getMessage()]
    assert len(skipped) == 1 and "tokenizer=tiktoken:gpt2" in skipped[0]
    batch = next(iter(trainer.state.train_dataloader))
    train = np.lib.stride_tricks.sliding_window_view(np.fromfile(nanogpt / "train.bin", "<u2"), L)
    assert batch["input_ids"].shape == (4, L) and "sequence_id" in batch
    assert all((train == row).all(1).any() for row in batch["input_ids"].numpy())  # windows
    assert "eval/val/loss" in trainer.fit().eval_metrics
    assert sorted(p.name for p in nanogpt.iterdir()) == ["train.bin", "val.bin"]  # nothing written


def test_a_bare_file_is_refused_in_one_line_that_names_the_fix(nanogpt: Path):
    with pytest.raises(MissingInput, match=r"train.bin has no sidecar train.json: describe it once"
                       r" with `python data_prep/adopt_tokens.py .*or set data.dtype and "
                       r"data.vocab_size"):  # fmt: skip
        windows(nanogpt, dtype=None, vocab_size=None)
    with pytest.raises(UserError, match=r"holds token id 99, not below vocab_size=50"):
        windows(nanogpt, vocab_size=50, eos_id=None)  # a vocabulary too small for the ids
    with pytest.raises(UserError, match="give vocab_size, the tokenizer's"):
        windows(nanogpt, vocab_size=None)
    (nanogpt / "odd.bin").write_bytes(b"\0" * 6)
    with pytest.raises(UserError, match=r"6 bytes, not a whole number of uint32 tokens"):
        MemmapTokens(str(nanogpt), file="odd.bin", val_fraction=None, max_seq_len=1,
                     dtype="uint32", vocab_size=VOCAB)  # fmt: skip
    (nanogpt / "train.json").write_text(json.dumps({"dtype": "uint16", "vocab_size": VOCAB}))
    with pytest.raises(UserError, match=r"train.json is not a llmfoundry.tokens sidecar .*"
                       r"write it with data_prep/adopt_tokens.py"):  # fmt: skip
        windows(nanogpt)
    adopt_tokens(nanogpt / "train.bin", dtype="uint16", vocab_size=VOCAB, overwrite=True)
    with pytest.raises(UserError, match=r"vocab_size=128 was given but .*train.json records 100"):
        windows(nanogpt, vocab_size=128)


def script(name: str, *args: str) -> int:
    """data_prep/<name>.py's main in this process; its exit status (a user error: 2)."""
    try:
        return runpy.run_path(str(ROOT / "data_prep" / name), run_name="t")["main"](list(args))
    except SystemExit as exit:  # a user error: one line on stderr
        return exit.code


def test_adopt_tokens_py_writes_each_sidecar_once(nanogpt: Path, capsys):
    files = [str(nanogpt / "train.bin"), str(nanogpt / "val.bin")]
    assert script("adopt_tokens.py", *files, *FACTS) == 0
    assert "train.bin: 4,000 uint16 tokens, ids below 100" in capsys.readouterr().out
    meta = json.loads((nanogpt / "val.json").read_text())
    assert (meta["num_tokens"], meta["vocab_size"], meta["eos_id"]) == (800, VOCAB, EOS)
    assert (
        meta["tokenizer"] is None and windows(nanogpt, dtype=None, vocab_size=None).eos_id is None
    )
    assert script("adopt_tokens.py", *files, *FACTS) == 0  # the same facts: kept as they are
    wrong = ["--dtype", "uint32", "--vocab-size", str(VOCAB)]  # two uint16 ids read as one
    assert script("adopt_tokens.py", files[1], *wrong) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not below vocab_size=100: give the tokenizer's" in err
    assert script("adopt_tokens.py", files[1], *FACTS[:4], "--eos-id", "0") == 2
    assert (
        "val.json already describes val.bin otherwise; pass --overwrite" in capsys.readouterr().err
    )
    assert script("adopt_tokens.py", files[1], *FACTS[:4], "--overwrite") == 0
    assert json.loads((nanogpt / "val.json").read_text())["eos_id"] is None


@pytest.mark.slow  # a train.py subprocess (~30 s on 2 loaded cores); the in-process test above
def test_adopted_pair_trains_with_train_py_and_no_data_flags(nanogpt: Path, tmp_path: Path):
    """The README's "Bring your own token files": the sidecars once, then plain commands."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, *args], cwd=tmp_path, env=env, capture_output=True, text=True,
            timeout=600,
        )  # fmt: skip

    adopt = run(str(ROOT / "data_prep/adopt_tokens.py"), "owt/train.bin", "owt/val.bin", *FACTS)
    assert adopt.returncode == 0, adopt.stderr
    trained = run(
        str(ROOT / "scripts/train.py"), "data=memmap", "data.remote=owt",
        "data.split_files={train: train.bin, val: val.bin}", "data.val_fraction=null",
        "data.sequence_id_from_eos=auto", "model.vocab_size=128", f"model.max_seq_len={L}",
        "model.d_model=16", "model.n_heads=2", "model.n_layers=1", "global_train_batch_size=4",
        "max_duration=2ba", "scheduler.t_warmup=1ba", "eval_interval=2ba",
        "eval_subset_num_batches=1", "run_name=owt",
    )  # fmt: skip
    assert trained.returncode == 0, trained.stdout[-2000:] + trained.stderr[-2000:]
    assert "eval/val/loss" in trained.stdout + trained.stderr
    assert trained.stderr.count("generate: no samples") == 1  # the default callbacks, no tokenizer
    assert "scripts/generate.py outputs/owt/checkpoints --tokenizer TOKENIZER" in trained.stdout


def tokens_to_mds(*args: str) -> int:
    return script("tokens_to_mds.py", *args)


def test_tokens_to_mds_converts_a_bare_file_without_a_tokenizer(nanogpt: Path, tmp_path, capsys):
    bare, out = str(nanogpt / "train.bin"), str(tmp_path / "mds")
    assert tokens_to_mds(bare, "--out", out, "--seq-len", "16", "--no-progress") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "adopt_tokens.py" in err and "--vocab-size N" in err
    args = [bare, "--out", out, "--seq-len", "16", "--val-rows", "5", "--no-progress"]
    assert tokens_to_mds(*args, *FACTS) == 0
    meta = json.loads((tmp_path / "mds" / "meta.json").read_text())
    assert (meta["vocab_size"], meta["eos_id"], meta["tokenizer"]) == (VOCAB, EOS, None)
    assert meta["splits"]["train"]["rows"] == 245 and meta["splits"]["val"]["rows"] == 5
    assert meta["splits"]["val"]["text_bytes"] is None and meta["dtype"] == "uint16"
    assert not (tmp_path / "mds" / "tokenizer.json").exists()
    from llmfoundry.data.streaming import StreamingDataset

    rows = StreamingDataset(out, str(tmp_path / "cache"), split="val")
    want = np.fromfile(bare, dtype=np.uint16)[245 * 16 : 250 * 16].reshape(5, 16)
    assert np.array_equal(np.stack([rows[i]["tokens"] for i in range(5)]), want)
    capsys.readouterr()
    assert tokens_to_mds(*args, *FACTS) == 0 and "up to date, reused" in capsys.readouterr().out


def test_tokens_to_mds_takes_a_hand_written_sidecar(nanogpt: Path, tmp_path: Path):
    """What a user wrote by hand before adopt_tokens.py existed: no fingerprint, no tokenizer."""
    sidecar = {"format": "llmfoundry.tokens", "tokens_file": "val.bin", "dtype": "uint16",
               "num_tokens": 800, "vocab_size": VOCAB}  # fmt: skip
    (nanogpt / "val.json").write_text(json.dumps(sidecar))
    args = [str(nanogpt / "val.bin"), "--out", str(tmp_path / "mds"), "--seq-len", "16"]
    assert tokens_to_mds(*args, "--no-progress") == 0
    meta = json.loads((tmp_path / "mds" / "meta.json").read_text())
    assert (meta["splits"]["train"]["rows"], meta["vocab_size"], meta["eos_id"]) == (
        50,
        VOCAB,
        None,
    )
    (nanogpt / "val.json").write_text(json.dumps({**sidecar, "vocab_size": 50}))
    assert tokens_to_mds(*args, "--no-progress", "--overwrite") == 2  # ids past its vocabulary
    (nanogpt / "val.json").write_text(json.dumps(sidecar))
    np.fromfile(nanogpt / "val.bin", dtype=np.uint16)[::-1].tofile(nanogpt / "val.bin")
    os.utime(nanogpt / "val.bin", ns=(1, 1))  # another file of the same size: not reused
    assert tokens_to_mds(*args, "--no-progress") == 2


def test_a_pair_converts_with_val_bin_as_the_val_split(nanogpt: Path, tmp_path: Path, capsys):
    """nanoGPT's val.bin is the val split whole (--val-tokens), not the tail of train.bin: bare
    with the facts given, and adopted (sidecars, no flags) alike."""
    from llmfoundry.data.streaming import StreamingDataset

    train_bin, val_bin = nanogpt / "train.bin", nanogpt / "val.bin"
    out = tmp_path / "mds"
    args = [str(train_bin), "--out", str(out), "--seq-len", "16", "--val-tokens", str(val_bin)]
    assert tokens_to_mds(*args, "--no-progress", *FACTS) == 0
    meta = json.loads((out / "meta.json").read_text())
    assert {name: (s["rows"], s["tokens"], s["source_tokens"]) for name, s in meta["splits"].items()} == {
        "train": (4000 // 16, 4000, str(train_bin)), "val": (800 // 16, 800, str(val_bin))
    }  # fmt: skip
    assert meta["dropped_tokens"] == 0 and meta["vocab_size"] == VOCAB and meta["eos_id"] == EOS
    val = StreamingDataset(str(out), str(tmp_path / "cache"), split="val")
    got = np.stack([val[i]["tokens"] for i in range(len(val))])
    assert np.array_equal(got, np.fromfile(val_bin, dtype=np.uint16).reshape(50, 16))
    assert script("mds_tools.py", "verify", str(out)) == 0  # sizes, hashes, ids below vocab_size

    adopt_tokens(train_bin, dtype="uint16", vocab_size=VOCAB, eos_id=EOS)
    assert tokens_to_mds(*args, "--no-progress", "--overwrite") == 2  # val.bin has no sidecar
    assert "val.bin has no sidecar" in capsys.readouterr().err
    adopt_tokens(val_bin, dtype="uint16", vocab_size=VOCAB + 1, overwrite=True)
    assert tokens_to_mds(*args, "--no-progress", "--overwrite") == 2  # another vocabulary
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "has vocab_size 101 but" in err and "same tokenizer" in err
    adopt_tokens(val_bin, dtype="uint16", vocab_size=VOCAB, eos_id=EOS, overwrite=True)
    assert tokens_to_mds(*args, "--no-progress", "--overwrite") == 0
    assert json.loads((out / "meta.json").read_text())["splits"]["val"]["rows"] == 50
    assert tokens_to_mds(*args, "--val-rows", "5") == 2  # the val split is given twice
    assert "not allowed with argument" in capsys.readouterr().err


def test_an_adopted_file_converts_to_mds_on_s3(nanogpt: Path, s3_env: str, tmp_path: Path):
    s3fs = pytest.importorskip("s3fs")
    bucket = f"adopt-{tmp_path.name.lower().replace('_', '-')[-30:]}"
    s3fs.S3FileSystem(skip_instance_cache=True).mkdir(bucket)
    adopt_tokens(nanogpt / "train.bin", dtype="uint16", vocab_size=VOCAB, eos_id=EOS)
    url = f"s3://{bucket}/owt/mds"
    assert tokens_to_mds(str(nanogpt / "train.bin"), "--out", url, "--seq-len", "16",
                         "--val-rows", "5", "--no-progress") == 0  # fmt: skip
    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    meta = json.loads(fs.cat_file(f"{url}/meta.json"))
    assert (meta["vocab_size"], meta["eos_id"], meta["splits"]["train"]["rows"]) == (
        VOCAB,
        EOS,
        245,
    )
    assert fs.exists(f"{url}/train/index.json") and fs.exists(f"{url}/val/index.json")


def test_a_torch_dataloader_of_samples_trains_or_is_refused_in_one_line(nanogpt: Path, tmp_path):
    ds = windows(nanogpt)  # no batch_size: one window per item, batched by the DataLoader
    batches = list(DataLoader(ds, batch_size=4))
    assert batches[0]["input_ids"].shape == (4, L) and len(batches) == -(-len(ds) // 4)
    train = functools.partial(
        Trainer, model=tiny_model(vocab_size=128, seq_len=L), max_duration="2ba",
        optimizer=functools.partial(torch.optim.SGD, lr=0.1), run_dir=tmp_path, precision="fp32",
    )  # fmt: skip
    assert train(train_dataloader=DataLoader(ds, batch_size=4)).fit().timestamp.batch == 2
    with pytest.raises(UserError, match=r"labels have shape \[16\], not \[batch, seq\]: .*"
                       r"StreamingDataLoader\(dataset\) .*DataLoader\(dataset, batch_size=B\)"):  # fmt: skip
        train(train_dataloader=DataLoader(ds, batch_size=None)).fit()

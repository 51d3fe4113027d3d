"""data_prep: text -> token memmap -> MDS, verify and merge; sources, parallelism, reruns."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import fsspec
import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from llmfoundry.data.mds import ShardReader, decompress, load_index, parse_index
from llmfoundry.data.prep import (
    EOS_TOKEN,
    bytes_per_token,
    merge_indexes,
    open_doc_index,
    open_tokens,
    sources,
    text_to_tokens,
    token_byte_lengths,
    tokens_to_mds,
    train_bpe,
    verify_mds,
)
from llmfoundry.data.prep.reuse import previous_output
from llmfoundry.utils.errors import UserError

REPO = Path(__file__).parents[2]
FIXTURES = REPO.parent / "shared" / "fixtures" / "mds"

DOCS = {
    "a/one.txt": "Hello world.\nThis is the first document.\n",
    "a/two.txt": "naïve café ☕ — unicode survives; so does a literal <|endoftext|> in text.",
    "b/three.txt": "def f(x):\n    return x * 2  # code\n\n\n" * 20,
    "b/skip_me.txt": "excluded by --exclude",
    "b/tests_dir/deep.txt": "excluded with its directory",
    "b/notes.md": "not matched by --glob",
    "c/empty.txt": "",
    "c/latin1.txt": None,  # not UTF-8: skipped
    "z.txt": "last " * 300,
}
EXCLUDES = ["skip_*", "b/tests_dir"]
KEPT = ["a/one.txt", "a/two.txt", "b/three.txt", "z.txt"]  # sorted order, empty/latin1 skipped


def _load_cli(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "data_prep" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    for rel, text in DOCS.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"caf\xe9" if text is None else text.encode("utf-8"))
    return root


@pytest.fixture(scope="module")
def prepared(corpus, tmp_path_factory) -> Path:
    """Token stream of the corpus with a freshly trained tokenizer."""
    out = tmp_path_factory.mktemp("tok") / "tokens.bin"
    meta = text_to_tokens(
        [str(corpus)],
        out,
        train_tokenizer=True,
        vocab_size=300,
        excludes=EXCLUDES,
        doc_boundaries=True,
        progress=False,
    )
    assert not meta["reused"]
    return out


def _docs_from_stream(path: Path) -> list[str]:
    tokens, meta = open_tokens(path)
    tok = Tokenizer.from_file(str(path.parent / meta["tokenizer"]))
    eos = meta["eos_id"]
    ends = np.flatnonzero(np.asarray(tokens) == eos)
    assert ends[-1] == len(tokens) - 1  # every document, the last included, ends with EOS
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [
        tok.decode(tokens[s:e].tolist(), skip_special_tokens=False)
        for s, e in zip(starts, ends, strict=True)
    ]


# -- text -> tokens ---------------------------------------------------------------------------


def test_round_trip_text_folder(prepared):
    tokens, meta = open_tokens(prepared)
    assert meta["dtype"] == "uint16" and tokens.dtype == np.uint16
    assert meta["num_documents"] == len(KEPT) and meta["skipped_documents"] == 2
    assert 257 <= meta["vocab_size"] <= 300 and int(tokens.max()) < meta["vocab_size"]
    assert _docs_from_stream(prepared) == [DOCS[k] for k in KEPT]
    # The literal "<|endoftext|>" inside a document is text, not an EOS id.
    assert int(np.count_nonzero(np.asarray(tokens) == meta["eos_id"])) == len(KEPT)
    starts = open_doc_index(prepared)
    eos_positions = np.flatnonzero(np.asarray(tokens) == meta["eos_id"])
    assert starts.tolist() == [0, *(eos_positions[:-1] + 1).tolist()]
    assert (prepared.parent / "tokenizer.json").is_file()


def test_parallel_equals_serial_and_bounded_tasks(prepared, corpus, tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "TASK_BYTES", 1)  # one file per task: many tasks
    tok = prepared.parent / "tokenizer.json"
    kwargs = dict(tokenizer=tok, excludes=EXCLUDES, progress=False, doc_boundaries=True)
    serial = text_to_tokens([str(corpus)], tmp_path / "s" / "t.bin", workers=1, **kwargs)
    parallel = text_to_tokens([str(corpus)], tmp_path / "p" / "t.bin", workers=2, **kwargs)
    assert (tmp_path / "s" / "t.bin").read_bytes() == (tmp_path / "p" / "t.bin").read_bytes()
    assert (tmp_path / "s" / "t.docs.bin").read_bytes() == (
        tmp_path / "p" / "t.docs.bin"
    ).read_bytes()
    assert serial["num_tokens"] == parallel["num_tokens"] == open_tokens(prepared)[1]["num_tokens"]
    assert len(sources.plan_tasks([str(corpus)], excludes=EXCLUDES)) >= 5  # ~one per file


def test_rerun_is_idempotent_and_detects_changes(prepared, corpus, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(corpus, src)
    out = tmp_path / "o" / "t.bin"
    tok = prepared.parent / "tokenizer.json"
    first = text_to_tokens([str(src)], out, tokenizer=tok, progress=False)
    stamp = out.stat().st_mtime_ns
    again = text_to_tokens([str(src)], out, tokenizer=tok, progress=False)
    assert again["reused"] and not first["reused"] and out.stat().st_mtime_ns == stamp
    (src / "a" / "one.txt").write_text("changed text")
    with pytest.raises(FileExistsError, match="--overwrite"):
        text_to_tokens([str(src)], out, tokenizer=tok, progress=False)
    redone = text_to_tokens([str(src)], out, tokenizer=tok, progress=False, overwrite=True)
    assert not redone["reused"] and _docs_from_stream(out)[0] == "changed text"


def test_tokenizer_next_to_output_is_protected(prepared, corpus, tmp_path):
    tok = prepared.parent / "tokenizer.json"
    out = tmp_path / "o"
    text_to_tokens([str(corpus)], out / "a.bin", tokenizer=tok, progress=False)
    with pytest.raises(FileExistsError, match="holds a different tokenizer"):
        text_to_tokens(
            [str(corpus)], out / "b.bin", train_tokenizer=True, vocab_size=270, progress=False
        )
    (out / "tokenizer.json").write_text((out / "tokenizer.json").read_text() + "\n")
    with pytest.raises(FileExistsError, match="no longer the tokenizer"):
        text_to_tokens([str(corpus)], out / "a.bin", tokenizer=tok, progress=False)


def test_jsonl_and_parquet_sources_with_bos_and_cap(prepared, tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    pa = pytest.importorskip("pyarrow")
    rows = [f"row {i}: " + "word " * (i % 7) for i in range(40)]
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text("\n".join(json.dumps({"text": r, "id": i}) for i, r in enumerate(rows)) + "\n")
    parquet = tmp_path / "d.parquet"
    pq.write_table(pa.table({"text": rows}), parquet, row_group_size=8)
    tok = prepared.parent / "tokenizer.json"
    out = tmp_path / "out" / "t.bin"
    meta = text_to_tokens([str(jsonl), str(parquet)], out, tokenizer=tok, progress=False)
    assert meta["num_documents"] == 80
    assert _docs_from_stream(out) == rows + rows

    bos = text_to_tokens(
        [str(jsonl)], tmp_path / "bos" / "t.bin", tokenizer=tok, bos_token="<|endoftext|>",
        max_bytes=len("".join(rows[:5]).encode()), progress=False,
    )  # fmt: skip
    tokens, _ = open_tokens(tmp_path / "bos" / "t.bin")
    assert bos["num_documents"] == 5 and tokens[0] == bos["eos_id"]  # BOS before the first doc

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"body": "x"}\n')
    with pytest.raises(ValueError, match="no field 'text'.*--text-field"):
        text_to_tokens([str(bad)], tmp_path / "bad" / "t.bin", tokenizer=tok, progress=False)


def test_saved_hf_dataset_source(prepared, tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = ["first hf doc", "second hf doc", "third"]
    datasets.Dataset.from_dict({"content": rows}).save_to_disk(str(tmp_path / "ds"))
    out = tmp_path / "out" / "t.bin"
    text_to_tokens(
        [str(tmp_path / "ds")], out, tokenizer=prepared.parent / "tokenizer.json",
        text_field="content", progress=False,
    )  # fmt: skip
    assert _docs_from_stream(out) == rows


def test_large_vocabulary_uses_uint32(tmp_path):
    vocab = {f"w{i}": i for i in range(70_000)}
    vocab["<|endoftext|>"] = 70_000
    vocab["[UNK]"] = 70_001
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "big.json"))
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("w1 w69999 w5")
    meta = text_to_tokens(
        [str(tmp_path / "docs")], tmp_path / "o" / "t.bin", tokenizer=tmp_path / "big.json",
        progress=False,
    )  # fmt: skip
    tokens, _ = open_tokens(tmp_path / "o" / "t.bin")
    assert meta["dtype"] == "uint32" and tokens.tolist() == [1, 69999, 5, 70_000]


def test_bad_arguments(corpus, tmp_path):
    with pytest.raises(ValueError, match="exactly one of --tokenizer"):
        text_to_tokens([str(corpus)], tmp_path / "t.bin", progress=False)
    with pytest.raises(ValueError, match=r"must end in \.bin"):
        text_to_tokens([str(corpus)], tmp_path / "t.npy", train_tokenizer=True)
    with pytest.raises(ValueError, match="no files in .* match --glob"):
        text_to_tokens([str(corpus)], tmp_path / "t.bin", train_tokenizer=True, globs=["*.rs"])
    with pytest.raises(FileNotFoundError, match="does not exist"):
        text_to_tokens([str(tmp_path / "nope")], tmp_path / "t.bin", train_tokenizer=True)


# -- tokens -> MDS ----------------------------------------------------------------------------


def _rows(folder: Path, tmp: Path) -> np.ndarray:
    out = []
    for info in load_index(folder):
        path = folder / info.raw_basename
        if info.zip_data is not None:
            path = tmp / info.raw_basename
            path.write_bytes(
                decompress(
                    (folder / info.zip_basename).read_bytes(),
                    info.compression,
                    info.raw_data.bytes,
                )
            )
        out.append(np.array(ShardReader(path, info).array("tokens")))
    return np.concatenate(out)


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_mds_rows_equal_memmap_windows(prepared, tmp_path, compression):
    tokens, meta = open_tokens(prepared)
    seq = 16
    out = tmp_path / "mds"
    tokens_to_mds(
        prepared, str(out), seq, val_fraction=0.1, size_limit=600, compression=compression,
        hashes=["xxh64"], progress=False,
    )  # fmt: skip
    rows = len(tokens) // seq
    n_val = max(1, round(rows * 0.1))
    windows = np.asarray(tokens[: rows * seq]).reshape(rows, seq)
    train, val = _rows(out / "train", tmp_path), _rows(out / "val", tmp_path)
    assert np.array_equal(train, windows[: rows - n_val]) and np.array_equal(val, windows[-n_val:])
    assert len(load_index(out / "train")) > 1  # size_limit rolled shards over
    assert load_index(out / "train")[0].column_encodings == (f"ndarray:uint16:{seq}",)
    saved = json.loads((out / "meta.json").read_text())
    assert saved["vocab_size"] == meta["vocab_size"] and saved["eos_id"] == meta["eos_id"]
    assert saved["dropped_tokens"] == len(tokens) - rows * seq
    assert (out / "tokenizer.json").read_bytes() == (
        prepared.parent / "tokenizer.json"
    ).read_bytes()
    assert tokens_to_mds(prepared, str(out), seq, val_fraction=0.1, size_limit=600,
                         compression=compression, hashes=["xxh64"], progress=False)["reused"]  # fmt: skip
    with pytest.raises(FileExistsError, match="--overwrite"):
        tokens_to_mds(prepared, str(out), 8, progress=False)
    redone = tokens_to_mds(prepared, str(out), 8, progress=False, overwrite=True)
    assert "val" not in redone["splits"] and not (out / "val").exists()
    assert np.array_equal(_rows(out / "train", tmp_path).ravel(), tokens[: (len(tokens) // 8) * 8])


def test_a_val_token_file_is_the_val_split_with_its_own_counts(prepared, corpus, tmp_path):
    """--val-tokens: a val file tokenized with the same tokenizer is the val split whole, and
    meta.json counts each split from its own file (seq_len 1 drops nothing)."""
    val_bin = tmp_path / "val" / "val.bin"
    val_text = "held out: café " * 40
    (tmp_path / "val.txt").write_text(val_text)
    text_to_tokens([str(tmp_path / "val.txt")], val_bin, tokenizer=prepared.parent / "tokenizer.json",
                   progress=False)  # fmt: skip
    meta = tokens_to_mds(prepared, str(tmp_path / "m"), 1, val_tokens=val_bin, progress=False)
    train, val = meta["splits"]["train"], meta["splits"]["val"]
    assert train["tokens"] == open_tokens(prepared)[1]["num_tokens"]
    assert val["tokens"] == open_tokens(val_bin)[1]["num_tokens"] == val["rows"]
    assert train["text_bytes"] == sum(len((corpus / rel).read_bytes()) for rel in KEPT)
    assert val["text_bytes"] == len(val_text.encode())
    assert (train["source_tokens"], val["source_tokens"]) == (str(prepared), str(val_bin))
    with pytest.raises(UserError, match="leave out --val-fraction"):
        tokens_to_mds(prepared, str(tmp_path / "m"), 1, val_tokens=val_bin, val_fraction=0.1)


def test_tokens_to_mds_to_fsspec_url(prepared, tmp_path):
    url = "memory://prep-test/mds"
    tokens_to_mds(prepared, url, 32, val_rows=2, compression="gz", progress=False)
    fs = fsspec.filesystem("memory")
    assert json.loads(fs.cat(f"{url}/meta.json"))["splits"]["val"]["rows"] == 2
    reports = verify_mds(url)
    assert [r.errors for r in reports] == [[], []] and reports[1].samples == 2
    fs.rm("/prep-test", recursive=True)


def test_meta_records_tokens_and_text_bytes_per_split(prepared, corpus, tmp_path):
    # seq_len 1 drops no token, so the splits' bytes add up to the source text's (multi-byte
    # characters included, wherever the train/val cut falls)
    meta = tokens_to_mds(prepared, str(tmp_path / "m"), 1, val_fraction=0.3, progress=False)
    assert meta["dropped_tokens"] == 0
    train, val = meta["splits"]["train"], meta["splits"]["val"]
    assert train["tokens"] + val["tokens"] == open_tokens(prepared)[1]["num_tokens"]
    source_bytes = sum(len((corpus / rel).read_bytes()) for rel in KEPT)
    assert train["text_bytes"] + val["text_bytes"] == source_bytes
    assert bytes_per_token(meta, "val") == val["text_bytes"] / val["tokens"]
    saved = json.loads((tmp_path / "m" / "meta.json").read_text())
    assert saved["splits"]["train"]["text_bytes"] == train["text_bytes"]
    # the same as decoding the split with the tokenizer, skipping EOS
    rows = tokens_to_mds(prepared, str(tmp_path / "r"), 16, val_rows=3, progress=False)
    tok = Tokenizer.from_file(str(prepared.parent / "tokenizer.json"))
    stream = open_tokens(prepared)[0]
    ids = [int(t) for t in stream[: rows["splits"]["train"]["tokens"]]]
    decoded = tok.decode(ids, skip_special_tokens=True).encode("utf-8")
    assert rows["splits"]["train"]["text_bytes"] == len(decoded)


def test_token_byte_lengths_exact_for_byte_level_only():
    tok = train_bpe(["naïve café ☕ " * 20, "def f(x):\n    return x"], 300)
    lengths = token_byte_lengths(tok)
    text = "naïve ☕ café, return x"
    ids = tok.encode(text).ids + [tok.token_to_id(EOS_TOKEN)]
    assert int(lengths[ids].sum()) == len(text.encode("utf-8"))
    assert lengths[tok.token_to_id(EOS_TOKEN)] == 0
    word_level = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    assert token_byte_lengths(word_level) is None


def test_bytes_per_token_none_where_not_recorded():
    assert bytes_per_token({}, "val") is None
    old = {"splits": {"val": {"rows": 2, "shards": 1, "folder": "val"}}}  # written before
    assert bytes_per_token(old, "val") is None and bytes_per_token(old, "train") is None
    assert bytes_per_token({"splits": {"val": {"tokens": 4, "text_bytes": None}}}, "val") is None
    assert bytes_per_token({"splits": {"val": {"tokens": 4, "text_bytes": 10}}}, "val") == 2.5


@pytest.mark.parametrize("kind", ["byte_level", "word_level"])
def test_token_ids_outside_the_tokenizer_are_refused(prepared, tmp_path, kind):
    """Before any shard is written, whatever the tokenizer (text bytes are counted only for a
    byte-level one)."""
    bad = tmp_path / "bad"
    bad.mkdir()
    tokens, meta = open_tokens(prepared)
    np.full(64, 299 + 1000, np.uint16).tofile(bad / "tokens.bin")
    if kind == "byte_level":
        shutil.copy(prepared.parent / "tokenizer.json", bad / "tokenizer.json")
        vocab = meta["vocab_size"]  # what text_to_tokens recorded of the trained BPE
    else:
        vocab = 2
        word_level = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
        word_level.save(str(bad / "tokenizer.json"))
    (bad / "tokens.json").write_text(json.dumps({**meta, "num_tokens": 64}))
    with pytest.raises(
        UserError,
        match=rf"bad/tokens.bin: token id 1299 is not in its tokenizer's vocabulary of {vocab} ids",
    ):
        tokens_to_mds(bad / "tokens.bin", str(tmp_path / "m"), 8, progress=False)
    assert not (tmp_path / "m" / "train").exists()  # refused before writing


def test_split_errors(prepared, tmp_path):
    with pytest.raises(ValueError, match="leave no training rows"):
        tokens_to_mds(prepared, str(tmp_path / "m"), 16, val_fraction=0.999, progress=False)
    with pytest.raises(ValueError, match="fewer than one row"):
        tokens_to_mds(prepared, str(tmp_path / "m"), 10**9, progress=False)


# -- verify and merge -------------------------------------------------------------------------


def test_verify_detects_corruption_and_vocab(prepared, tmp_path, capsys):
    out = tmp_path / "mds"
    tokens_to_mds(prepared, str(out), 16, val_rows=3, hashes=["sha1"], progress=False)
    verify = _load_cli("mds_tools")
    assert verify(["verify", str(out)]) == 0
    assert "samples" in capsys.readouterr().out
    reports = verify_mds(str(out), vocab_size=100)
    assert any("outside the vocabulary [0, 100)" in e for e in reports[0].errors)
    shard = out / "train" / load_index(out / "train")[0].raw_basename
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert verify(["verify", str(out)]) == 1
    printed = capsys.readouterr().out
    assert "ERROR" in printed and str(shard) in printed and "sha1" in printed


@pytest.mark.skipif(not (FIXTURES / "splits").is_dir(), reason="../shared/fixtures absent")
def test_merge_matches_reference_merged_index(tmp_path):
    for split in ("train", "val"):
        shutil.copytree(FIXTURES / "splits" / split, tmp_path / split)
    merged = merge_indexes(str(tmp_path))
    assert (tmp_path / "index.json").read_bytes() == (
        FIXTURES / "splits" / "index.json"
    ).read_bytes()
    assert merged[0].raw_basename == "train/shard.00000.mds"
    reports = verify_mds(str(tmp_path))
    assert len(reports) == 1 and reports[0].samples == 37 and not reports[0].errors


def test_merge_explicit_folders_into_out(prepared, tmp_path, capsys):
    """``merge A B --out C``: a folder inside C is referenced in place, one elsewhere is copied."""
    tools = _load_cli("mds_tools")
    tokens_to_mds(prepared, str(tmp_path / "code"), 16, val_rows=2, compression="zstd",
                  progress=False)  # fmt: skip
    mix = tmp_path / "mix"
    tokens_to_mds(prepared, str(mix / "docs"), 16, val_rows=2, progress=False)
    code_train, docs_train = tmp_path / "code" / "train", mix / "docs" / "train"
    assert tools(["merge", str(code_train), str(docs_train), "--out", str(mix)]) == 0
    assert f"copied {code_train} into {mix}" in capsys.readouterr().out
    merged = load_index(mix)
    assert {s.raw_basename.rsplit("/", 1)[0] for s in merged} == {"train", "docs/train"}
    assert merged[0].raw_basename.startswith("train/")  # the order given on the command line
    assert (mix / "train" / "index.json").read_bytes() == (code_train / "index.json").read_bytes()
    expected = sum(s.samples for s in load_index(code_train) + load_index(docs_train))
    reports = verify_mds(str(mix))
    assert not reports[0].errors and reports[0].samples == expected
    assert tools(["merge", str(tmp_path / "code")]) == 0  # DIR alone still merges sub-folders
    assert "['train', 'val']" in capsys.readouterr().out
    for argv, message in [
        ([str(code_train), str(docs_train)], "no --out: give the folder for the merged"),
        ([str(tmp_path / "nowhere"), "--out", str(mix)], "has no index.json: give folders"),
        ([str(code_train), "--out", str(mix)], "already holds a dataset"),
        ([str(mix), "--out", str(mix)], "is --out itself"),
        ([str(docs_train), str(mix / "docs" / "val"), str(docs_train), "--out", str(mix)],
         "land in"),
    ]:  # fmt: skip
        with pytest.raises(SystemExit) as exit_info:
            tools(["merge", *argv])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err


def test_clis_end_to_end(corpus, tmp_path, capsys):
    to_tokens, to_mds, tools = (
        _load_cli(n) for n in ("text_to_tokens", "tokens_to_mds", "mds_tools")
    )
    for main in (to_tokens, to_mds, tools):
        with pytest.raises(SystemExit) as exc:
            main(["--help"])
        assert exc.value.code == 0
    out = tmp_path / "t" / "tokens.bin"
    args = [str(corpus), "--out", str(out), "--train-tokenizer", "--vocab-size", "280",
            "--exclude", "skip_*", "--no-progress", "--workers", "2"]  # fmt: skip
    assert to_tokens(args) == 0
    assert "written" in capsys.readouterr().out
    assert to_tokens(args) == 0
    assert "reused" in capsys.readouterr().out
    mds = tmp_path / "mds"
    assert to_mds([str(out), "--out", str(mds), "--seq-len", "8", "--val-fraction", "0.2",
                   "--no-progress"]) == 0  # fmt: skip
    assert tools(["merge", str(mds)]) == 0
    assert [s.raw_basename.split("/")[0] for s in load_index(mds)][-1] == "val"
    assert tools(["verify", str(mds)]) == 0
    with pytest.raises(SystemExit) as exit_info:
        to_mds([str(out), "--out", str(mds), "--seq-len", "0"])
    assert exit_info.value.code == 2
    assert "--seq-len must be positive" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--seq-len must be positive"):  # --debug: the exception
        to_mds([str(out), "--out", str(mds), "--seq-len", "0", "--debug"])


# -- object store ----------------------------------------------------------------------------


def test_tokens_to_mds_uploads_to_s3(prepared, s3_env):
    fs = fsspec.filesystem("s3", client_kwargs={"endpoint_url": s3_env}, skip_instance_cache=True)
    fs.mkdir("prep-bucket")
    tokens_to_mds(prepared, "s3://prep-bucket/ds", 16, val_rows=2, compression="zstd",
                  hashes=["xxh64"], progress=False)  # fmt: skip
    fs.invalidate_cache()
    assert sorted(p.split("/")[-1] for p in fs.ls("prep-bucket/ds")) == [
        "meta.json", "tokenizer.json", "train", "val",
    ]  # fmt: skip
    shards = parse_index(fs.cat("prep-bucket/ds/train/index.json"))
    assert all(fs.exists(f"prep-bucket/ds/train/{s.zip_basename}") for s in shards)
    reports = verify_mds("s3://prep-bucket/ds")
    assert [r.errors for r in reports] == [[], []]


def test_tokens_to_mds_names_a_missing_bucket_before_writing_and_how_to_create_it(
    prepared, s3_env, capsys
):
    from data_prep.tokens_to_mds import main as to_mds

    with pytest.raises(SystemExit) as exit_info:
        to_mds([str(prepared), "--out", "s3://nobucket-prep/x", "--seq-len", "16"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "--out s3://nobucket-prep/x is not writable" in err
    assert "bucket 'nobucket-prep' does not exist" in err and "aws s3 mb s3://nobucket-prep" in err


def test_previous_output_reuses_refuses_or_clears_meta(tmp_path):
    """One rule for every prep step writing meta.json (tokens_to_mds, instructions)."""
    meta = tmp_path / "meta.json"
    meta.write_text(json.dumps({"fingerprint": "a", "rows": 3}))
    assert previous_output(str(tmp_path), "a", overwrite=False) == {"fingerprint": "a", "rows": 3}
    with pytest.raises(FileExistsError, match="pass --overwrite"):
        previous_output(str(tmp_path), "b", overwrite=False)
    assert meta.exists()
    assert previous_output(str(tmp_path), "a", overwrite=True) is None
    assert not meta.exists()  # must not describe the splits about to be rewritten
    assert previous_output(str(tmp_path), "a", overwrite=False) is None


# In a fresh interpreter: both scripts of the text -> MDS path, run as a user runs them; then
# whether torch was imported (seconds of every data_prep command's start, for nothing).
_PREP_WITHOUT_TORCH = r"""
import runpy, sys
corpus, out = sys.argv[1:]
for argv in (
    ["data_prep/text_to_tokens.py", corpus, "--train-tokenizer", "--vocab-size", "300",
     "--out", f"{out}/tokens.bin", "--no-progress"],
    ["data_prep/tokens_to_mds.py", f"{out}/tokens.bin", "--seq-len", "16", "--val-rows", "2",
     "--out", f"{out}/mds", "--no-progress"],
):
    sys.argv = argv
    try:
        runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exit:
        assert not exit.code, exit.code
print("torch" in sys.modules)
"""


def test_text_to_mds_scripts_do_not_import_torch(tmp_path):
    root = Path(__file__).resolve().parents[2]
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("def add(a, b):\n    return a + b\n" * 40)
    result = subprocess.run(
        [sys.executable, "-c", _PREP_WITHOUT_TORCH, str(corpus), str(tmp_path)],
        cwd=root, env={**os.environ, "PYTHONPATH": str(root)},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "mds" / "meta.json").is_file()
    assert result.stdout.splitlines()[-1] == "False"

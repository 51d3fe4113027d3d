"""MDS format: fixtures from mosaicml-streaming read back exactly and rewritten byte for byte."""

from __future__ import annotations

import hashlib
import importlib.util
import json
from decimal import Decimal
from pathlib import Path

import fsspec
import numpy as np
import pytest

from llmfoundry.data.mds import (
    MDSWriter,
    ShardCorruptError,
    ShardReader,
    UnsafeEncodingError,
    compress,
    decompress,
    digest,
    extension,
    get_encoding,
    load_index,
    parse_index,
    verify_shard,
)
from llmfoundry.utils.files import parse_size

FIXTURES = Path(__file__).parents[1].parent.parent / "shared" / "fixtures" / "mds"
needs_fixtures = pytest.mark.skipif(
    not (FIXTURES / "expected.json").is_file(), reason="../shared/fixtures/mds is absent"
)
FIXTURE_NAMES = ["tokens_fixed", "tokens_var_zstd", "mixed", "splits/train", "splits/val"]


def _expected() -> dict:
    return json.loads((FIXTURES / "expected.json").read_text())


def _as_json(value):
    """A decoded value in expected.json's notation."""
    if isinstance(value, np.ndarray):
        return {"ndarray": value.tolist(), "dtype": value.dtype.name, "shape": list(value.shape)}
    if isinstance(value, bytes):
        return {"bytes_hex": value.hex()}
    if isinstance(value, np.generic):
        return value.item()
    return value


def _from_json(value, encoding: str):
    """expected.json's notation -> the Python value a user would write."""
    if isinstance(value, dict) and "ndarray" in value:
        return np.array(value["ndarray"], dtype=value["dtype"]).reshape(value["shape"])
    if isinstance(value, dict) and encoding == "bytes":
        return bytes.fromhex(value["bytes_hex"])
    return value


def _raw_shard(folder: Path, info, tmp_path: Path) -> Path:
    """Local path of the decompressed shard (decompressing into tmp_path when needed)."""
    if info.zip_data is None:
        return folder / info.raw_basename
    zipped = folder / info.zip_basename
    verify_shard(zipped, info)
    raw = tmp_path / info.raw_basename
    raw.parent.mkdir(parents=True, exist_ok=True)
    raw.write_bytes(decompress(zipped.read_bytes(), info.compression, info.raw_data.bytes))
    return raw


def _read_all(folder: Path, tmp_path: Path) -> list[dict]:
    samples = []
    for info in load_index(folder):
        path = _raw_shard(folder, info, tmp_path)
        verify_shard(path, info)
        with ShardReader(path, info) as reader:
            samples += [reader.get(i) for i in range(len(reader))]
    return samples


# -- fixtures ---------------------------------------------------------------------------------


@needs_fixtures
@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_reader_matches_expected(name, tmp_path):
    expected = _expected()[name]
    got = _read_all(FIXTURES / name, tmp_path)
    assert [{k: _as_json(v) for k, v in s.items()} for s in got] == expected["samples"]


@needs_fixtures
def test_merged_index_with_subfolder_basenames(tmp_path):
    shards = load_index(FIXTURES / "splits")
    assert shards[0].raw_basename == "train/shard.00000.mds"
    got = _read_all(FIXTURES / "splits", tmp_path)
    exp = _expected()
    assert [_as_json(s["tokens"]) for s in got] == [
        s["tokens"] for s in exp["splits/train"]["samples"] + exp["splits/val"]["samples"]
    ]


@needs_fixtures
@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_writer_is_byte_identical(name, tmp_path):
    spec = _expected()[name]
    out = tmp_path / "out"
    with MDSWriter(out, spec["columns"], **spec["writer_args"]) as writer:
        for sample in spec["samples"]:
            writer.write({k: _from_json(v, spec["columns"][k]) for k, v in sample.items()})
    ref = FIXTURES / name
    assert (out / "index.json").read_bytes() == (ref / "index.json").read_bytes()
    ours, theirs = load_index(out), load_index(ref)
    assert [s.raw_data for s in ours] == [s.raw_data for s in theirs]
    for a, b in zip(ours, theirs, strict=True):
        mine, reference = (
            (out / a.stored.basename).read_bytes(),
            (ref / b.stored.basename).read_bytes(),
        )
        if a.compression is not None and a.compression.startswith("gz"):
            # The one documented difference: the gzip header's mtime (bytes 4-7; the reference
            # writes the time, we write 0) and OS byte (9). Deflate data and trailer are equal.
            assert len(mine) == len(reference)
            assert {i for i in range(len(mine)) if mine[i] != reference[i]} <= {4, 5, 6, 7, 9}
            size = a.raw_data.bytes
            assert decompress(mine, a.compression, size) == decompress(
                reference, b.compression, size
            )
        else:
            assert mine == reference  # raw shards and zstd shards: byte for byte


@needs_fixtures
def test_whole_shard_view_is_zero_copy():
    folder = FIXTURES / "tokens_fixed"
    info = load_index(folder)[0]
    expected = [s["tokens"]["ndarray"] for s in _expected()["tokens_fixed"]["samples"][:8]]
    with ShardReader(folder / info.raw_basename, info) as reader:
        rows = reader.array("tokens")
        assert rows.shape == (8, 16) and rows.dtype == np.uint16
        assert rows.tolist() == expected
        one = reader.get_array(3, "tokens")
        assert one.tolist() == expected[3]
        assert not one.flags.writeable and not rows.flags.writeable  # views of the mmap
        assert np.shares_memory(rows, reader.array("tokens"))


# -- encodings --------------------------------------------------------------------------------

ROUND_TRIP = [
    ("int", -(2**63)), ("int8", -128), ("int16", 32767), ("int32", -5), ("int64", 2**62),
    ("uint8", 255), ("uint16", 65535), ("uint32", 2**32 - 1), ("uint64", 2**64 - 1),
    ("float16", 0.5), ("float32", 1.25), ("float64", -3.0e300), ("bytes", b"\x00\xffab"),
    ("str", "naïve ☕\n"), ("str_int", 10**40), ("str_float", 0.1), ("str_decimal", Decimal("1.10")),
    ("json", {"a": [1, 2.5, None], "b": "x"}),
]  # fmt: skip


@pytest.mark.parametrize(("name", "value"), ROUND_TRIP)
def test_scalar_and_text_round_trip(name, value):
    coder = get_encoding(name)
    data = coder.encode(value)
    if coder.size is not None:
        assert len(data) == coder.size
    back = coder.decode(data)
    assert back == value
    assert type(back.item() if isinstance(back, np.generic) else back) is type(value)


DTYPES = ["uint8", "int8", "uint16", "int16", "float16", "uint32", "int32", "float32", "uint64",
          "int64", "float64"]  # fmt: skip
NDARRAY_FORMS = [
    *[("ndarray", dt, (2, 3)) for dt in DTYPES],  # dynamic dtype and shape
    *[("ndarray::2,3", dt, (2, 3)) for dt in DTYPES],  # dynamic dtype, static shape
    *[(f"ndarray:{dt}", dt, (3, 1, 2)) for dt in DTYPES],  # static dtype, dynamic shape
    *[(f"ndarray:{dt}:6", dt, (6,)) for dt in DTYPES],  # static dtype and shape
]


@pytest.mark.parametrize(("name", "dtype", "shape"), NDARRAY_FORMS)
def test_ndarray_forms_round_trip(name, dtype, shape):
    coder = get_encoding(name)
    arr = (np.arange(int(np.prod(shape))) % 100 - 7).astype(dtype).reshape(shape)
    data = coder.encode(arr)
    back = coder.decode(data)
    assert back.dtype == arr.dtype and back.shape == arr.shape and np.array_equal(back, arr)
    header = (coder.dtype is None) + (0 if coder.shape else 1 + len(shape))
    assert len(data) == header + arr.nbytes
    assert coder.size == (arr.nbytes if coder.dtype and coder.shape else None)


def test_ndarray_worked_example_and_shape_codes():
    coder = get_encoding("ndarray:int32")
    data = coder.encode(np.arange(4, dtype=np.int32))
    assert data[:2] == bytes([0x04, 0x04]) and len(data) == 18
    big = np.zeros((1, 300), np.uint8)
    assert get_encoding("ndarray").encode(big)[:2] == bytes([8, (2 << 2) | 1])
    huge = np.zeros(70000, np.uint8)
    enc = get_encoding("ndarray:uint8").encode(huge)
    assert enc[0] == (1 << 2) | 2 and enc[1:5] == np.uint32(70000).tobytes()


def test_encoding_errors_are_clear():
    with pytest.raises(ValueError, match="unknown MDS encoding 'nope'"):
        get_encoding("nope")
    with pytest.raises(ValueError, match="expects dtype uint16"):
        get_encoding("ndarray:uint16").encode(np.zeros(3, np.int32))
    with pytest.raises(ValueError, match="expects shape"):
        get_encoding("ndarray:uint16:4").encode(np.zeros(3, np.uint16))
    with pytest.raises(ValueError, match="zero elements"):
        get_encoding("ndarray").encode(np.zeros(0, np.int32))
    with pytest.raises(ValueError, match="does not fit"):
        get_encoding("uint8").encode(256)
    with pytest.raises(ValueError, match="corrupt ndarray"):
        get_encoding("ndarray:int32").decode(b"\x04\x04abc")


def test_pickle_refused_unless_allowed():
    data = get_encoding("pkl").encode({"x": 1})
    with pytest.raises(UnsafeEncodingError, match="allow_unsafe=True"):
        get_encoding("pkl").decode(data)
    assert get_encoding("pkl", allow_unsafe=True).decode(data) == {"x": 1}


def test_pickle_column_refused_by_reader(tmp_path):
    with MDSWriter(tmp_path, {"obj": "pkl"}) as writer:
        writer.write({"obj": {"x": 1}})
    info = load_index(tmp_path)[0]
    with pytest.raises(UnsafeEncodingError, match="allow_unsafe"):
        ShardReader(tmp_path / info.raw_basename, info).get(0)
    assert ShardReader(tmp_path / info.raw_basename, info, allow_unsafe=True).get(0) == {
        "obj": {"x": 1}
    }


def test_images_round_trip():
    image_mod = pytest.importorskip("PIL.Image")
    img = image_mod.fromarray((np.arange(48).reshape(4, 4, 3) * 5).astype(np.uint8))
    for name in ("pil", "png"):
        back = get_encoding(name).decode(get_encoding(name).encode(img))
        assert np.array_equal(np.asarray(back), np.asarray(img))
    assert get_encoding("jpeg:90").decode(get_encoding("jpeg:90").encode(img)).size == (4, 4)


# -- compression and hashing ------------------------------------------------------------------


@pytest.mark.parametrize("algo", ["zstd", "zstd:7", "gz", "gz:1", "bz2", "br", "snappy"])
def test_compression_round_trip(algo):
    module = {"br": "brotli", "snappy": "snappy"}.get(algo)
    data = bytes(range(256)) * 50
    if module and importlib.util.find_spec(module) is None:
        with pytest.raises(ImportError, match="pip install"):
            compress(data, algo)
        return
    assert decompress(compress(data, algo), algo, len(data)) == data
    assert extension(algo) == algo.split(":")[0]


def test_compression_errors():
    with pytest.raises(ValueError, match="unknown compression 'lz4'"):
        compress(b"x", "lz4")
    with pytest.raises(ValueError, match="levels are 1..22"):
        compress(b"x", "zstd:99")
    with pytest.raises(ValueError, match="corrupt zstd data"):
        decompress(b"not zstd", "zstd", 100)
    assert compress(b"abc" * 100, "gz") == compress(b"abc" * 100, "gz")  # mtime 0: reproducible


def test_hashes_match_reference_algorithms():
    assert digest("sha1", b"abc") == hashlib.sha1(b"abc").hexdigest()
    assert digest("sha3_256", b"abc") == hashlib.sha3_256(b"abc").hexdigest()
    assert digest("xxh64", b"") == "ef46db3751d8e999"
    assert digest("xxh3_64", b"") == "2d06800538d394c2"
    with pytest.raises(ValueError, match="unknown hash 'crc'"):
        digest("crc", b"")


# -- index ------------------------------------------------------------------------------------


def _index_text(**overrides) -> str:
    entry = {
        "column_encodings": ["int"], "column_names": ["x"], "column_sizes": [8],
        "compression": None, "format": "mds", "hashes": [],
        "raw_data": {"basename": "shard.00000.mds", "bytes": 10, "hashes": {}},
        "samples": 1, "size_limit": 100, "version": 2, "zip_data": None,
    }  # fmt: skip
    entry.update(overrides)
    return json.dumps({"shards": [entry], "version": 2})


def test_index_rejects_bad_entries():
    assert parse_index(_index_text())[0].columns == {"x": "int"}
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['extra'\]"):
        parse_index(_index_text(extra=1))
    with pytest.raises(ValueError, match="size 4 but its encoding gives 8"):
        parse_index(_index_text(column_sizes=[4]))
    for bad in ("../evil.mds", "/etc/passwd", "a/../../b", "C:/x"):
        raw = {"basename": bad, "bytes": 10, "hashes": {}}
        with pytest.raises(ValueError, match="unsafe shard basename"):
            parse_index(_index_text(raw_data=raw))
    with pytest.raises(ValueError, match="zip_data must be given"):
        parse_index(_index_text(compression="zstd"))


def test_load_index_missing_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="no MDS index"):
        load_index(tmp_path)


# -- writer behaviour -------------------------------------------------------------------------


def test_rollover_rule_and_oversized_sample(tmp_path):
    with MDSWriter(tmp_path, {"b": "bytes"}, size_limit=400) as writer:
        overhead = writer._shard_overhead  # 8 + config JSON
        for size in (10, 500, 10, 10):
            writer.write({"b": b"x" * size})
    shards = load_index(tmp_path)
    # 500 bytes overflow on their own: closed shard [10], then a shard of its own [500].
    assert [s.samples for s in shards] == [1, 1, 2]
    assert shards[1].raw_data.bytes == overhead + 4 + 4 + 500
    assert all(s.raw_data.bytes <= 400 or s.samples == 1 for s in shards)


def test_writer_size_limit_text_and_exist_ok(tmp_path):
    assert parse_size("64mb") == 1 << 26 and parse_size("1.5kb") == 1536
    with MDSWriter(tmp_path, {"x": "int"}, size_limit="1kb") as writer:
        writer.write({"x": 1})
    with pytest.raises(FileExistsError, match="exist_ok=True"):
        MDSWriter(tmp_path, {"x": "int"})
    (tmp_path / "keep.txt").write_text("mine")
    with MDSWriter(tmp_path, {"x": "int"}, exist_ok=True) as writer:
        writer.write({"x": 2})
    assert (tmp_path / "keep.txt").exists()
    info = load_index(tmp_path)[0]
    assert ShardReader(tmp_path / info.raw_basename, info).get(0) == {"x": 2}


def test_writer_errors_and_abort(tmp_path):
    with pytest.raises(KeyError, match=r"missing \['y'\], unexpected \['z'\]"):
        MDSWriter(tmp_path / "a", {"x": "int", "y": "str"}).write({"x": 1, "z": 2})
    with pytest.raises(TypeError, match="column 'y'"):
        MDSWriter(tmp_path / "b", {"y": "str"}).write({"y": 3})
    with pytest.raises(RuntimeError, match="boom"):
        with MDSWriter(tmp_path / "c", {"x": "int"}, size_limit=100) as writer:
            for i in range(20):
                writer.write({"x": i})
            raise RuntimeError("boom")
    assert not (tmp_path / "c" / "index.json").exists()
    assert not list((tmp_path / "c").glob("shard.*"))


def test_writer_to_fsspec_url_uploads_index_last(tmp_path):
    url = "memory://mds-writer-test/ds"
    fs = fsspec.filesystem("memory")
    with MDSWriter(
        url, {"t": "ndarray:uint32:4"}, compression="zstd", hashes=["xxh64"], size_limit=200
    ) as writer:
        for i in range(20):
            writer.write({"t": np.arange(4, dtype=np.uint32) + i})
    shards = parse_index(fs.cat(f"{url}/index.json"))
    assert len(shards) > 1
    local = tmp_path / "local"
    fs.get(f"{url}/", str(local), recursive=True)
    rows = []
    for info in shards:
        verify_shard(local / info.zip_basename, info)
        path = _raw_shard(local, info, tmp_path / "raw")
        rows += list(ShardReader(path, info).array("t"))
    assert np.array_equal(np.stack(rows), np.arange(4)[None, :] + np.arange(20)[:, None])
    fs.rm("/mds-writer-test", recursive=True)


# -- corruption -------------------------------------------------------------------------------


def _tiny_dataset(folder: Path, hashes=("sha1", "xxh64")):
    with MDSWriter(folder, {"t": "ndarray:uint16:8"}, hashes=list(hashes)) as writer:
        for i in range(10):
            writer.write({"t": np.full(8, i, np.uint16)})
    info = load_index(folder)[0]
    return folder / info.raw_basename, info


def test_flipped_byte_detected_by_hash(tmp_path):
    path, info = _tiny_dataset(tmp_path)
    verify_shard(path, info)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(ShardCorruptError, match=str(path)):
        verify_shard(path, info)


def test_truncated_shard_detected_on_open(tmp_path):
    path, info = _tiny_dataset(tmp_path)
    path.write_bytes(path.read_bytes()[:-5])
    with pytest.raises(ShardCorruptError, match=rf"{path}.*last offset"):
        ShardReader(path, info)
    path.write_bytes(b"\x01")
    with pytest.raises(ShardCorruptError, match="too short"):
        ShardReader(path, info)


def test_wrong_sample_count_detected(tmp_path):
    path, info = _tiny_dataset(tmp_path)
    data = bytearray(path.read_bytes())
    data[0] = 9
    path.write_bytes(bytes(data))
    with pytest.raises(ShardCorruptError, match="header says 9 samples"):
        ShardReader(path, info)

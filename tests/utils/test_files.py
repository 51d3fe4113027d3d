"""Atomic writes, URL joining and size parsing (llmfoundry.utils.files)."""

from pathlib import Path

import pytest

from llmfoundry.utils.files import atomic_path, atomic_write, join_url, parse_size


def test_atomic_write_bytes_text_and_writer(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "f.bin"
    atomic_write(target, b"one")
    assert target.read_bytes() == b"one"
    atomic_write(target, "two")
    assert target.read_text() == "two"
    atomic_write(target, lambda p: p.write_bytes(b"three"))
    assert target.read_bytes() == b"three"
    assert sorted(p.name for p in target.parent.iterdir()) == ["f.bin"]  # no temp file left


def test_failed_write_keeps_old_file_and_leaves_no_temp(tmp_path: Path) -> None:
    target = tmp_path / "f.bin"
    target.write_bytes(b"old")

    def broken(path: Path) -> None:
        path.write_bytes(b"half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        atomic_write(target, broken)
    with pytest.raises(KeyError), atomic_path(target) as tmp:
        tmp.write_bytes(b"partial")
        raise KeyError("interrupted")
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["f.bin"]


@pytest.mark.parametrize(
    ("url", "parts", "want"),
    [
        ("s3://b/data/", ("train", "index.json"), "s3://b/data/train/index.json"),
        ("/local/x", ("", "y"), "/local/x/y"),
        ("memory://root", (), "memory://root"),
        ("/", ("a",), "/a"),
    ],
)
def test_join_url(url: str, parts: tuple[str, ...], want: str) -> None:
    assert join_url(url, *parts) == want


def test_parse_size_units_and_errors() -> None:
    assert parse_size("64mb") == 1 << 26 and parse_size("1.5kb") == 1536
    assert parse_size(7) == 7 and parse_size(None) is None
    with pytest.raises(ValueError, match="unknown size unit in data.cache_limit='3xb'"):
        parse_size("3xb", "data.cache_limit")
    with pytest.raises(ValueError, match="size_limit must be positive"):
        parse_size(0, "size_limit")
    with pytest.raises(ValueError, match="bad size"):
        parse_size(True)

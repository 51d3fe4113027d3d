"""A shard cache cannot be poisoned (issue 32.3): a cached shard changed in place is noticed on
its first use in each process, a cache folder someone else can write is refused, and the default
folder is the user's own and names the endpoint as well as the URL."""

from __future__ import annotations

import grp
import logging
import os
import pwd
import stat
import tempfile
from pathlib import Path

import numpy as np
import pytest

from llmfoundry.data.mds import MDSWriter
from llmfoundry.data.streaming import StreamingDataLoader, StreamingDataset
from llmfoundry.data.streaming import cache as cache_mod
from llmfoundry.data.streaming.stream import default_cache_dir
from llmfoundry.utils.errors import UserError

SEQ = 8


def write(folder, n: int = 24, **kwargs) -> None:
    """``n`` rows ``arange(SEQ) + i`` in shards of a few rows, with xxh64 hashes by default."""
    kwargs.setdefault("hashes", ("xxh64",))
    with MDSWriter(folder, {"tokens": f"ndarray:uint16:{SEQ}"}, size_limit=200, **kwargs) as w:
        for i in range(n):
            w.write({"tokens": (np.arange(SEQ) + i).astype(np.uint16)})


def firsts(ds) -> list[int]:
    return sorted(int(s["tokens"][0]) for s in ds)


def poison(shard: Path) -> None:
    """Change the shard's last row in place, same size: what the size check cannot see."""
    raw = bytearray(shard.read_bytes())
    raw[-2 * SEQ :] = (np.arange(SEQ) + 900).astype(np.uint16).tobytes()
    shard.write_bytes(bytes(raw))


@pytest.mark.parametrize("validate_hash", [None, "xxh64"])
def test_a_cached_shard_changed_in_place_is_fetched_again(tmp_path, validate_hash, caplog):
    remote, cache = tmp_path / "remote", tmp_path / "cache"
    write(remote)
    assert firsts(StreamingDataset(str(remote), str(cache))) == list(range(24))  # warm cache
    victim = cache / "shard.00001.mds"
    poison(victim)
    with caplog.at_level(logging.WARNING, logger=cache_mod.__name__):
        ds = StreamingDataset(str(remote), str(cache), validate_hash=validate_hash)
        assert firsts(ds) == list(range(24))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and str(victim) in warnings[0] and "xxh64" in warnings[0]
    assert victim.read_bytes() == (remote / victim.name).read_bytes()


def test_an_s3_shard_changed_in_its_default_cache_is_fetched_again(s3_env, tmp_path, monkeypatch):
    s3fs = pytest.importorskip("s3fs")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "systemp"))
    (tmp_path / "systemp").mkdir()
    s3fs.S3FileSystem.clear_instance_cache()
    s3fs.S3FileSystem().mkdir("poison")
    url = "s3://poison/ds"
    write(url, compression="zstd")
    assert firsts(StreamingDataset(url)) == list(range(24))  # no local: the default cache
    victim = default_cache_dir(url) / "shard.00001.mds"
    clean = victim.read_bytes()
    poison(victim)
    assert firsts(StreamingDataset(url)) == list(range(24))
    assert victim.read_bytes() == clean
    s3fs.S3FileSystem.clear_instance_cache()


@pytest.mark.parametrize("validate_hash", [None, "xxh64"])
def test_a_changed_in_place_shard_is_refused_naming_it(tmp_path, validate_hash):
    data = tmp_path / "data"
    write(data)
    poison(data / "shard.00002.mds")
    ds = StreamingDataset(str(data), validate_hash=validate_hash)  # in place: the only copy
    with pytest.raises(UserError, match=r"shard\.00002\.mds: xxh64 is .*only copy") as err:
        firsts(ds)
    assert "\n" not in str(err.value)


def test_each_process_hashes_a_shard_once(tmp_path, monkeypatch):
    """Hashed on first use, not per sample nor per epoch; a DataLoader worker (a forked copy of
    a dataset its parent already checked) checks again, so a shard changed meanwhile is caught."""
    remote, cache = tmp_path / "remote", tmp_path / "cache"
    write(remote, 60)
    StreamingDataset(str(remote), str(cache))[0]  # another process fetched shard 0 earlier
    hashed: list[str] = []
    verify = cache_mod.verify_file
    monkeypatch.setattr(
        cache_mod,
        "verify_file",
        lambda path, *a, **k: hashed.append(Path(path).name) or verify(path, *a, **k),
    )
    ds = StreamingDataset(str(remote), str(cache), batch_size=4)
    for epoch in range(2):
        ds.set_epoch(epoch)
        assert firsts(ds) == list(range(60))
    shards = len(ds.caches[0].shards)
    assert hashed == ["shard.00000.mds"]  # fetched here, so checked as downloaded; 0 once
    assert all((cache / f"shard.{j:05}.mds").is_file() for j in range(shards))
    poison(cache / "shard.00003.mds")
    rows = [r for b in StreamingDataLoader(ds, num_workers=2) for r in b["tokens"][:, 0]]
    assert sorted(int(r) for r in rows) == list(range(60))


def user() -> str:
    return pwd.getpwuid(os.geteuid()).pw_name


def test_cache_folders_others_can_write_are_refused(tmp_path, monkeypatch):
    remote, cache = tmp_path / "remote", tmp_path / "cache"
    write(remote)
    cache.mkdir()
    cache.chmod(0o777)  # e.g. made by someone else for everyone
    (cache / "shard.00000.mds").write_bytes(b"planted")
    with pytest.raises(UserError, match=rf"cache folder {cache} is writable by group/others"):
        StreamingDataset(str(remote), str(cache))
    cache.chmod(0o755)  # the user's own folder, as mkdir makes it
    assert firsts(StreamingDataset(str(remote), str(cache))) == list(range(24))
    cache.chmod(0o775)  # as mkdir makes it under umask 002, with the user's private group
    monkeypatch.setattr(grp, "getgrgid", lambda gid: grp.struct_group((user(), "x", gid, [])))
    assert firsts(StreamingDataset(str(remote), str(cache))) == list(range(24))
    shared = grp.struct_group(("staff", "x", cache.stat().st_gid, [user(), "someone"]))
    monkeypatch.setattr(grp, "getgrgid", lambda gid: shared)  # a group others are in
    with pytest.raises(UserError, match="writable by group/others"):
        StreamingDataset(str(remote), str(cache))
    me = os.geteuid()
    monkeypatch.setattr(os, "geteuid", lambda: me + 1)  # now the folder is another user's
    with pytest.raises(UserError, match=rf"{cache} belongs to uid {me}, not to this user"):
        StreamingDataset(str(remote), str(cache))


def test_the_default_cache_is_private_to_the_user(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "systemp"))
    (tmp_path / "systemp").mkdir(mode=0o1777)
    data = tmp_path / "zipped"  # compressed shards: decompressed into the default cache
    write(data, compression="zstd")
    root = default_cache_dir(str(data)).parent
    assert root == tmp_path / "systemp" / f"llmfoundry-streaming-{os.geteuid()}"
    root.mkdir(mode=0o777)  # planted by the first user of the machine, open to all
    root.chmod(0o777)
    with pytest.raises(UserError, match=rf"{root} is writable by group/others"):
        StreamingDataset(str(data))
    root.rmdir()
    assert firsts(StreamingDataset(str(data))) == list(range(24))
    for folder in (root, default_cache_dir(str(data))):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700


def test_the_default_cache_names_user_endpoint_and_url(monkeypatch):
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    url = "s3://bucket/x"
    here, there = {"endpoint_url": "http://a:9000"}, {"endpoint_url": "http://b:9000"}
    assert default_cache_dir(url, here) != default_cache_dir(url, there)
    nested = {"client_kwargs": {"endpoint_url": "http://b:9000"}}
    assert default_cache_dir(url, nested) not in (
        default_cache_dir(url),
        default_cache_dir(url, here),
    )
    assert default_cache_dir(url, {**here, "key": "k2", "secret": "s2"}) == default_cache_dir(
        url, here
    )
    plain = default_cache_dir(url)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://a:9000")
    assert default_cache_dir(url) != plain
    assert default_cache_dir("s3://bucket/y") != default_cache_dir(url)
    assert plain.parent.name == f"llmfoundry-streaming-{os.geteuid()}"

"""Storage options configured once reach every filesystem (llmfoundry.utils.storage)."""

import runpy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from llmfoundry.checkpoint.catalogue import read_latest
from llmfoundry.data.streaming.download import read_bytes
from llmfoundry.utils import storage
from llmfoundry.utils.errors import UserError

ROOT = Path(__file__).resolve().parents[2]


class _SpyFS(MemoryFileSystem):
    """A memory filesystem that records the options it was created with."""

    protocol = "spyfs"
    seen: list[dict[str, Any]] = []

    def __init__(self, **options: Any) -> None:
        _SpyFS.seen.append(options)
        super().__init__()


@pytest.fixture
def spy() -> Iterator[type[_SpyFS]]:
    fsspec.register_implementation("spyfs", _SpyFS, clobber=True)
    _SpyFS.seen.clear()
    _SpyFS.clear_instance_cache()
    yield _SpyFS
    _SpyFS.clear_instance_cache()


def test_configured_options_reach_every_caller(spy: type[_SpyFS]) -> None:
    storage.configure({"endpoint_url": "http://minio:9000", "anon": False})
    fs, path = storage.url_to_fs("spyfs://bucket/run/latest")
    fs.pipe_file(path, b"ep0-ba1\n")
    assert read_latest("spyfs://bucket/run") == "ep0-ba1"  # checkpoint io
    assert read_bytes("spyfs://bucket/run/latest") == b"ep0-ba1\n"  # data download
    assert spy.seen and all(
        o == {"endpoint_url": "http://minio:9000", "anon": False} for o in spy.seen
    )


def test_prefix_overrides_and_call_options_win(spy: type[_SpyFS]) -> None:
    storage.configure(
        {"endpoint_url": "http://a", "profile": "default"},
        overrides={"spyfs://other/": {"endpoint_url": "http://b"}},
    )
    assert storage.options_for("spyfs://bucket/x") == {
        "endpoint_url": "http://a",
        "profile": "default",
    }
    assert storage.options_for("spyfs://other/x") == {
        "endpoint_url": "http://b",
        "profile": "default",
    }
    assert storage.options_for("spyfs://other/x", {"profile": "p"})["profile"] == "p"
    with storage.open_url("spyfs://other/f.txt", "w") as f:
        f.write("hi")
    assert spy.seen[-1] == {"endpoint_url": "http://b", "profile": "default"}


def test_a_runs_saved_settings_fill_in_only_what_this_process_leaves_unset() -> None:
    storage.configure({"profile": "mine"}, overrides={"s3://b/": {"anon": True}})
    saved = {
        "options": {"endpoint_url": "http://saved", "profile": "theirs"},
        "overrides": {"s3://b/": {"anon": False, "region_name": "eu"}, "s3://c/": {"x": 1}},
    }
    with storage.falling_back_to(saved):
        assert storage.options_for("s3://a/k") == {
            "endpoint_url": "http://saved",
            "profile": "mine",
        }
        assert storage.options_for("s3://b/k")["anon"] is True
        assert storage.options_for("s3://b/k")["region_name"] == "eu"
        assert storage.options_for("s3://c/k")["x"] == 1
    assert storage.options_for("s3://a/k") == {"profile": "mine"}  # the process's own again


def test_local_paths_get_no_remote_options(tmp_path: Any) -> None:
    storage.configure({"endpoint_url": "http://a"})  # tests/conftest.py resets it
    assert storage.options_for(str(tmp_path)) == {}
    fs, path = storage.url_to_fs(str(tmp_path))
    assert fs.exists(path)


def test_bad_configuration_is_refused() -> None:
    with pytest.raises(ValueError, match="URL prefix"):
        storage.configure({}, overrides={"bucket": {"anon": True}})
    with pytest.raises(ValueError, match="mapping of fsspec options"):
        storage.configure(["endpoint_url"])  # type: ignore[arg-type]


def test_storage_settings_from_text_or_file(tmp_path) -> None:
    inline = "{options: {endpoint_url: 'http://127.0.0.1:9000', profile: null}}"
    assert storage.load_settings(inline) == {
        "options": {"endpoint_url": "http://127.0.0.1:9000", "profile": None}
    }
    path = tmp_path / "storage.yaml"
    path.write_text("overrides:\n  's3://other/':\n    profile: other\n")
    storage.configure_settings(storage.load_settings(str(path)))
    assert storage.options_for("s3://other/x") == {"profile": "other"}
    assert storage.options_for("s3://mine/x") == {}
    storage.configure_settings({"options": {"endpoint_url": "http://e", "profile": None}})
    assert storage.options_for("s3://mine/x") == {"endpoint_url": "http://e"}  # null = unset
    assert storage.options_for("/local/path") == {}
    with pytest.raises(ValueError, match="storage.option: unknown key"):
        storage.load_settings("{option: {profile: x}}")
    with pytest.raises(ValueError, match="not a YAML/JSON"):
        storage.load_settings("{options: [")


@pytest.mark.parametrize(
    "url", ["s3://AKIAKEY:SUPERSECRET@bucket/ckpt", "gs://user:SUPERSECRET@b/x"]
)
def test_credentials_in_an_object_store_url_are_refused_without_showing_them(url):
    for call in (storage.url_to_fs, storage.open_url):
        with pytest.raises(UserError) as info:
            call(url)
        message = str(info.value)
        assert "SUPERSECRET" not in message and "<redacted>@" in message
        assert "AWS_ACCESS_KEY_ID" in message and "\n" not in message


def test_generate_names_a_url_with_credentials_in_one_line_without_the_secret(capsys):
    generate = runpy.run_path(str(ROOT / "scripts" / "generate.py"), run_name="generate")
    with pytest.raises(SystemExit) as exit_:
        generate["main"](["s3://AKIAKEY:SUPERSECRET@bucket/ckpt", "--prompt", "hi"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1
    assert "SUPERSECRET" not in err and "<redacted>@" in err

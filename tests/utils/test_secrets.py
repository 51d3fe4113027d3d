import pytest

from llmfoundry.launch.job import secret_named
from llmfoundry.utils.secrets import (
    is_secret,
    redact_argv,
    redact_secrets,
    redact_text,
    redact_urls,
)

# Names of secrets, as configs, overrides and environments spell them.
SECRET_NAMES = [
    "api_key", "WANDB_API_KEY", "OPENAI_API_KEY", "apiKey", "hf_token", "HF_TOKEN",
    "HUGGING_FACE_HUB_TOKEN", "wandb_token", "auth_token", "bearer_token", "accessToken",
    "GITHUB_TOKEN", "sas_token", "token", "key", "storage_options.key", "storage.options.secret",
    "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "aws_session_token", "private_key",
    "account_key", "db_password", "passwd", "client_secret", "credentials", "gcp-credential",
    "api_keys", "ssh_keys", "Authorization", "loggers.wandb.api_key", "+data.storage_options.key",
    "hftoken", "clientSecret", "accesskey", "dbpassword",
]  # fmt: skip
# Names that look alike and are not secrets: printed configs keep them.
PLAIN_NAMES = [
    "tokenizer", "tokenizer_name", "load_ignore_keys", "save_ignore_keys", "max_tokens",
    "max_new_tokens", "prompt_tokens", "eos_token", "bos_token", "pad_token", "eos_token_id",
    "special_tokens", "add_special_tokens", "tokens_per_sec", "kv_n_heads", "n_heads",
    "sort_keys", "sort_key", "num_tokens", "keys", "tokens", "TOKENIZERS_PARALLELISM",
    "monitor", "endpoint_url", "profile", "maxtokens", "tokenizer_kwargs",
]  # fmt: skip


@pytest.mark.parametrize("name", SECRET_NAMES)
def test_secret_names_are_secret_everywhere(name):
    assert is_secret(name)
    assert secret_named(name)  # the launcher's refusal of secrets in rendered files
    assert redact_secrets({name: "v"}) == {}
    assert redact_text(f"{name}=v1 {name}: v2") == f"{name}=<redacted> {name}: <redacted>"


@pytest.mark.parametrize("name", PLAIN_NAMES)
def test_names_that_only_look_like_secrets_are_kept(name):
    assert not is_secret(name)
    assert not secret_named(name)
    assert redact_secrets({name: "v"}) == {name: "v"}
    assert redact_text(f"{name}=v1 {name}: v2") == f"{name}=v1 {name}: v2"


def test_secret_named_keys_are_dropped_at_any_depth_and_case():
    config = {
        "optimizer": {"lr": 3e-4},
        "api_key": "k",
        "HF_TOKEN": "t",
        "data": {
            "storage_options": {
                "key": "AKIA",
                "Secret": "s",
                "client_kwargs": {"endpoint_url": "http://x"},
            },
            "streams": [{"remote": "s3://b", "aws_secret_access_key": "s"}],
        },
        "db_password": "p",
        "tokenizer": "path/tokenizer.json",  # not a token
        "load_ignore_keys": ["optimizer"],
    }
    assert redact_secrets(config) == {
        "optimizer": {"lr": 3e-4},
        "tokenizer": "path/tokenizer.json",
        "load_ignore_keys": ["optimizer"],
        "data": {
            "storage_options": {"client_kwargs": {"endpoint_url": "http://x"}},
            "streams": [{"remote": "s3://b"}],
        },
    }
    assert config["api_key"] == "k"  # the input is not modified


def test_strings_lose_url_userinfo_and_secret_pairs():
    config = {
        "data": {"remote": "s3://AKIA:hunter2@minio:9000/bucket/mds"},
        "overrides": ["data.storage_options.secret=hunter3", "max_duration=10ba"],
        "override_dirname": "+data.storage_options.key=hunter4,max_duration=10ba",
    }
    assert redact_secrets(config) == {
        "data": {"remote": "s3://<redacted>@minio:9000/bucket/mds"},
        "overrides": ["data.storage_options.secret=<redacted>", "max_duration=10ba"],
        "override_dirname": "+data.storage_options.key=<redacted>,max_duration=10ba",
    }


def test_argv_and_log_lines():
    argv = [
        "storage.options={profile: r2, secret: 'a b', endpoint_url: http://u:pw@h:9000}",
        "--hf-token",
        "hf_abc",
        "data.remote=gs://bucket/x",
        "--debug",
    ]
    assert redact_argv(argv) == [
        "storage.options={profile: r2, secret: <redacted>, endpoint_url: http://<redacted>@h:9000}",
        "--hf-token",
        "<redacted>",
        "data.remote=gs://bucket/x",
        "--debug",
    ]
    line = "throughput/tokens_per_sec: 123 reading https://bob:pw@host/a"
    assert redact_urls(line) == "throughput/tokens_per_sec: 123 reading https://<redacted>@host/a"

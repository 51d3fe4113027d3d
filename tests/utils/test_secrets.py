from llmfoundry.utils.secrets import redact_argv, redact_secrets, redact_urls


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
        "tokenizer": "path/tokenizer.json",  # deliberately broad: *token* goes too
    }
    assert redact_secrets(config) == {
        "optimizer": {"lr": 3e-4},
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

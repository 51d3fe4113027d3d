from llmfoundry.loggers.hyperparameters import redact_secrets


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

"""The checkpoint settings in conf/train.yaml: validated before anything runs."""

from pathlib import Path

import pytest

from llmfoundry.config import ConfigError
from llmfoundry.config.preflight import check, compose_config
from llmfoundry.config.train_config import validate_config

CONF = Path(__file__).resolve().parents[2] / "conf"


def error_for(*overrides):
    with pytest.raises(ConfigError) as info:
        check(CONF, list(overrides))
    return str(info.value)


def test_defaults_save_into_the_run_folder():
    settings = validate_config(compose_config(CONF, ["run_name=demo"]))
    assert settings.save_folder == "outputs/demo/checkpoints"
    assert settings.autoresume is False and settings.load_path is None


def test_autoresume_needs_a_save_folder_that_survives_a_relaunch():
    message = error_for("autoresume=true")
    assert message.startswith("autoresume: save_folder=outputs/run-")
    assert "set run_name=<name>" in message
    check(CONF, ["autoresume=true", "run_name=fixed"])
    check(CONF, ["autoresume=true", "save_folder=s3://bucket/run/ckpt"])
    assert error_for("autoresume=true", "save_folder=null").startswith("autoresume: it continues")


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("save_interval=often", "save_interval: cannot parse time 'often'"),
        ("num_checkpoints_to_keep=0", "num_checkpoints_to_keep: must be -1 (keep all) or positive"),
        ("load_ignore_keys=[optimiser]", "load_ignore_keys: unknown key(s) ['optimiser']"),
        ("load_ignore_keys=[timestamp]", "load_ignore_keys: has 'timestamp' but not 'data'"),
        ("autoresume=yes", "autoresume: expected bool"),
    ],
)
def test_bad_checkpoint_settings(override, message):
    assert error_for(override).startswith(message)

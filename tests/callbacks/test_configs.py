"""Every callback and logger in conf/ composes, validates and builds from its yaml."""

from pathlib import Path

from hydra.utils import instantiate

from llmfoundry.config import validate_config
from llmfoundry.config.preflight import compose_config
from llmfoundry.trainer import Callback, LoggerDestination

CONF = Path(__file__).resolve().parents[2] / "conf"
# generate and icl_eval load a tokenizer file (icl_eval also its task files) when built; they are
# covered by the default-config test and tests/eval/test_icl_eval.py.
CALLBACKS = sorted(
    p.stem for p in (CONF / "callbacks").glob("*.yaml") if p.stem not in ("generate", "icl_eval")
)
LOGGERS = sorted(p.stem for p in (CONF / "loggers").glob("*.yaml"))


def test_every_callback_and_logger_config_builds():
    assert {
        "speed_monitor",
        "memory_monitor",
        "runtime_estimator",
        "early_stopper",
        "nan_detector",
    } <= set(CALLBACKS)
    assert {"console", "progress", "jsonl", "tensorboard", "wandb"} <= set(LOGGERS)
    cfg = compose_config(
        CONF,
        [f"callbacks=[{','.join(CALLBACKS)}]", f"loggers=[{','.join(LOGGERS)}]", "run_name=test"],
    )
    validate_config(cfg)
    for name in CALLBACKS:
        assert isinstance(instantiate(cfg.callbacks[name]), Callback), name
    for name in LOGGERS:
        assert isinstance(instantiate(cfg.loggers[name]), LoggerDestination), name
    assert cfg.callbacks.early_stopper.monitor == "eval/val/loss"
    assert cfg.loggers.wandb.name == "test"

"""Every callback and logger in conf/ composes, validates and builds from its yaml."""

import os
import subprocess
import sys
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


# In a fresh interpreter: the trainer and the classes of the default config's callbacks (what
# scripts/train.py imports for `make demo`), then HFCheckpointer; whether transformers was
# imported after each.
_DEFAULT_RUN_IMPORTS = r"""
import sys
from pathlib import Path
from hydra.utils import get_class
import llmfoundry.build
from llmfoundry.config.preflight import compose_config
cfg = compose_config(Path("conf").resolve(), [])
for node in cfg.callbacks.values():
    get_class(node._target_)
print("transformers" in sys.modules)
from llmfoundry.callbacks import HFCheckpointer
print("transformers" in sys.modules)
"""


def test_a_default_run_does_not_import_transformers():
    """Only HFCheckpointer needs transformers (a second or more of every run's start)."""
    result = subprocess.run(
        [sys.executable, "-c", _DEFAULT_RUN_IMPORTS],
        cwd=CONF.parent, env={**os.environ, "PYTHONPATH": str(CONF.parent)},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "True"]

"""Every conf/algorithms/*.yaml composes, validates, builds its algorithm and trains."""

from pathlib import Path

import pytest
from hydra.utils import instantiate

from llmfoundry.algorithms import GradientClipping, RandomTokenReplacement
from llmfoundry.config import validate_config
from llmfoundry.config.preflight import compose_config
from llmfoundry.trainer import Algorithm

from .helpers import make_trainer

CONF = Path(__file__).resolve().parents[2] / "conf"
# low_precision_layernorm is a converter now; its old algorithms/ spelling selects it
# (tests/models/test_converters.py).
CONVERTERS = {"low_precision_layernorm"}
NAMES = sorted(p.stem for p in (CONF / "algorithms").glob("*.yaml") if p.stem not in CONVERTERS)


def test_all_algorithms_have_configs():
    assert set(NAMES) >= {
        "gradient_clipping",
        "ema",
        "seq_length_warmup",
        "loss_spike_guard",
        "random_token_replacement",
    }


@pytest.mark.parametrize("name", NAMES)
def test_config_builds_an_algorithm_that_trains(tmp_path, name):
    header = f"# @package algorithms.{name}\n"
    assert (CONF / "algorithms" / f"{name}.yaml").read_text().startswith(header)
    cfg = compose_config(
        CONF, [f"algorithms=[{name}]", "model.vocab_size=64", "precision=amp_bf16"]
    )
    validate_config(cfg)
    assert list(cfg.algorithms) == [name]
    algorithm = instantiate(cfg.algorithms[name])
    assert isinstance(algorithm, Algorithm)
    state = make_trainer(tmp_path, algorithms=[algorithm], precision="amp_bf16").fit()
    assert state.timestamp.batch == 4


def test_user_algorithm_switched_on_from_the_command_line(tmp_path):
    cfg = compose_config(
        CONF, ["algorithms=[gradient_clipping,random_token_replacement]", "model.vocab_size=64"]
    )
    validate_config(cfg)
    algorithms = [instantiate(node) for node in cfg.algorithms.values()]
    assert [type(a) for a in algorithms] == [GradientClipping, RandomTokenReplacement]
    assert algorithms[1].vocab_size == 64 and algorithms[1].seed == cfg.seed
    make_trainer(tmp_path, algorithms=algorithms).fit()

"""The schema read from a target's source (llmfoundry/config/static_schema.py) is the imported
signature's, or a looser one (Any where an annotation names what is not loaded), or None: so the
check before torch is imported never refuses what the full check accepts."""

from __future__ import annotations

import typing
from pathlib import Path

import pytest
from hydra.utils import get_object
from omegaconf import OmegaConf

from llmfoundry.config import train_config
from llmfoundry.config.preflight import check
from llmfoundry.config.schema import _parameters
from llmfoundry.config.static_schema import static_schema
from llmfoundry.data import builder

CONF = Path(__file__).resolve().parents[2] / "conf"
GROUPS = ("data", "optimizer", "scheduler", "algorithms", "callbacks", "loggers", "strategy")


def _targets() -> list[str]:
    found = set()
    for group in GROUPS:
        for path in (CONF / group).glob("*.yaml"):
            target = OmegaConf.load(path).get("_target_")
            if isinstance(target, str):
                found.add(target)
    return sorted(found)


def _agrees(static: dict, imported: dict) -> None:
    assert static.keys() == imported.keys()
    for key, annotation in static.items():
        assert annotation is typing.Any or annotation == imported[key], key


@pytest.mark.parametrize("target", _targets())
def test_the_source_gives_the_imported_signature(target):
    schema = static_schema(target)
    assert schema is not None, f"{target}: not read from its source; its errors wait for torch"
    params, var_kwargs = _parameters(get_object(target))
    imported = {param.name: annotation for param, annotation in params}
    _agrees(schema.hints, imported)
    assert schema.var_kwargs == var_kwargs
    assert schema.required == [p.name for p, _ in params if p.default is p.empty]


def test_the_data_groups_own_keys_from_the_source():
    _agrees(train_config._static_data_hints(), builder.group_hints())


@pytest.mark.parametrize(
    "overrides",
    [["data=memmap"], ["data=finetune"], ["algorithms=[ema,gradient_clipping]"],
     ["callbacks=[speed_monitor,lr_monitor,early_stopper]"], ["optimizer=decoupled_lionw"],
     ["scheduler=inverse_sqrt_with_warmup"], ["loggers=[console,jsonl,progress]"]],
)  # fmt: skip
def test_every_group_option_passes(overrides):
    check(CONF, overrides)

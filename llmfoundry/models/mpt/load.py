"""Rebuild a trained MPTForCausalLM from a training checkpoint, for evaluation and tools.

A checkpoint records the run's config (`config.model` is the MPTConfig node) next to the
weights, so the model is rebuilt exactly as it was trained; nothing is unpickled.
"""

from __future__ import annotations

import dataclasses

from hydra.utils import instantiate
from omegaconf import OmegaConf

from llmfoundry.checkpoint.io import read_checkpoint
from llmfoundry.models.mpt.config import MPTConfig
from llmfoundry.models.mpt.model import MPTForCausalLM


def model_from_checkpoint(path: str, device: str = "cpu", **overrides) -> MPTForCausalLM:
    """The model saved at `path` (a checkpoint folder, or a save folder: its latest), in eval mode.

    `overrides` replace MPTConfig fields that do not change the weights (e.g. attn_impl).
    """
    checkpoint = read_checkpoint(path, rank=0)
    node = (checkpoint.state.get("config") or {}).get("model")
    if node is None:
        raise ValueError(
            f"checkpoint {checkpoint.path!r} records no model config (config.model); it was not "
            "written by scripts/train.py"
        )
    config = instantiate(OmegaConf.create(node))
    if not isinstance(config, MPTConfig):
        raise ValueError(f"checkpoint {checkpoint.path!r}: config.model is not an MPTConfig")
    config = dataclasses.replace(config, init_device="meta", **overrides)
    model = MPTForCausalLM(config)
    model.load_state_dict(checkpoint.model, strict=True, assign=True)
    return model.to(device).eval()

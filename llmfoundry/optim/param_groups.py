"""Parameter groups, and the weight decay each group gets.

The trainer hands every optimizer the groups `build_param_groups` makes: the model's parameters
split into ordinary weights and the norm / bias / embedding parameters, each group tagged and
named. The grouping alone changes nothing (both groups share every hyperparameter); an
optimizer's `no_decay_norm_bias_embedding` switch then exempts the tagged group from weight
decay. So the decision is one key in `conf/optimizer/*.yaml`, and any torch optimizer still
works on the same groups.

A module can also ask for a group of its own: an attribute `own_param_groups` mapping a
parameter's local name to `(tag, hyperparameters)`, e.g. infini-attention's gate,
`{"gate": ("infini_gate", {"lr": 1e-2, "weight_decay": 0.0})}`. Every parameter with the same
tag goes into one group carrying those keys (under `OWN_GROUP`, the tag), which override the
optimizer's: a group's "lr" is its own (the schedule scales it like any other), its
"weight_decay" its decoupled decay.

Decay is for the weights that multiply activations; shrinking a norm's gain, a bias or an
embedding row towards zero is a constraint the model did not ask for (the GPT-3 / nanoGPT
convention).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from llmfoundry.distributed import unwrap_model
from llmfoundry.utils.errors import UserError

# The key marking the norm / bias / embedding group, and the key holding each group's decoupled
# weight decay (torch's own "weight_decay" key stays 0 so torch never applies a coupled decay).
NORM_BIAS_EMBEDDING = "norm_bias_embedding"
DECOUPLED_DECAY = "decoupled_decay"
OWN_GROUP = "own_group"

_NORMS = (
    nn.LayerNorm,
    nn.RMSNorm,
    nn.GroupNorm,
    nn.BatchNorm1d,
    nn.BatchNorm2d,
    nn.BatchNorm3d,
    nn.SyncBatchNorm,
    nn.InstanceNorm1d,
    nn.InstanceNorm2d,
    nn.InstanceNorm3d,
)


def build_param_groups(model: nn.Module) -> list[dict[str, Any]]:
    """The model's parameters as named groups: ordinary weights, norms/biases/embeddings, then
    one group per `own_param_groups` tag.

    A parameter belongs to the second group if its module is a normalization layer or an
    embedding, or its own name is ``bias``. A tied parameter is listed once, under its first
    name; in MPT the token embedding is also the output head, so it counts as an embedding.
    Empty groups are left out.
    """
    model = unwrap_model(model)
    exempt: set[int] = set()
    own: dict[int, tuple[str, dict[str, Any]]] = {}
    for module in model.modules():
        requests = getattr(module, "own_param_groups", {})
        for local_name, param in module.named_parameters(recurse=False):
            if local_name in requests:
                own[id(param)] = requests[local_name]
            elif isinstance(module, (*_NORMS, nn.Embedding)) or local_name == "bias":
                exempt.add(id(param))
    split: dict[bool, tuple[list[str], list[nn.Parameter]]] = {False: ([], []), True: ([], [])}
    tagged: dict[str, dict[str, Any]] = {}
    for name, param in model.named_parameters():
        if id(param) in own:
            tag, overrides = own[id(param)]
            group = tagged.setdefault(
                tag,
                {"params": [], "param_names": [], NORM_BIAS_EMBEDDING: False, OWN_GROUP: tag},
            )
            if any(group.get(k, v) != v for k, v in overrides.items()):
                raise ValueError(f"parameters of group {tag!r} ask for different {overrides}")
            group.update(overrides)
            group["params"].append(param)
            group["param_names"].append(name)
            continue
        names, params = split[id(param) in exempt]
        names.append(name)
        params.append(param)
    plain = [
        {"params": params, "param_names": names, NORM_BIAS_EMBEDDING: flag}
        for flag, (names, params) in split.items()
        if params
    ]
    return plain + list(tagged.values())


def decoupled_groups(
    params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
    weight_decay: float,
    no_decay_norm_bias_embedding: bool,
) -> list[dict[str, Any]]:
    """Param groups with each group's decoupled weight decay under `DECOUPLED_DECAY`.

    A group's own ``weight_decay`` overrides the optimizer-wide one; the tagged norm / bias /
    embedding group gets 0 when `no_decay_norm_bias_embedding` is set.
    """
    given = list(params)
    if not given:
        raise UserError("the optimizer got an empty parameter list: the model has no parameters")
    groups = [dict(g) for g in given] if isinstance(given[0], dict) else [{"params": given}]
    if no_decay_norm_bias_embedding and not any(NORM_BIAS_EMBEDDING in g for g in groups):
        raise UserError(
            "optimizer.no_decay_norm_bias_embedding=true needs the parameter groups of "
            "llmfoundry.optim.build_param_groups(model) (the trainer passes them); it got plain "
            "parameters, so it cannot tell norms, biases and embeddings apart"
        )
    for group in groups:
        decay = group.pop("weight_decay", weight_decay)
        if no_decay_norm_bias_embedding and group.get(NORM_BIAS_EMBEDDING, False):
            decay = 0.0
        if decay < 0:
            raise UserError(f"optimizer.weight_decay must be >= 0, got {decay}")
        group[DECOUPLED_DECAY] = decay
    return groups


def decay_factor(group: dict[str, Any]) -> float:
    """The multiplier applied to a group's parameters before its update.

    Decoupled decay follows the schedule (lr / initial_lr), not the lr itself, so a recipe's
    decay strength does not change when its peak lr does.
    """
    return 1.0 - group[DECOUPLED_DECAY] * group["lr"] / group["initial_lr"]

"""The gradient norm of a model whose gradients may be DTensors on several meshes.

Under expert parallelism the experts' gradients live on the expert mesh (efsdp x ep) and the
other weights' on the data-parallel one; torch's `clip_grad_norm_` stacks every gradient's norm
into one tensor, which DTensor refuses across meshes. Here each mesh's gradients are normed
together (torch's `get_total_norm`, then gathered: every rank gets the whole norm) and the
norms combined; with one mesh (every other run) torch's own function runs as before.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor


def grad_norm(grads: Iterable[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of `grads` together (a plain tensor, the same on every rank)."""
    norms = []
    for group in _by_mesh(grads).values():
        norm = torch.nn.utils.get_total_norm(group)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if len(norms) == 1:
        return norms[0]
    return torch.stack([n.double() for n in norms]).square().sum().sqrt().float()


def clip_grad_norm_(params: Iterable[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_` over gradients on any number of meshes: scale them all
    by one factor so that their norm is at most `max_norm`; returns the norm before (a plain
    tensor, the same on every rank)."""
    params = [p for p in params if p.grad is not None]
    if len(_by_mesh(p.grad for p in params)) <= 1:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm
    norm = grad_norm(p.grad for p in params)
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for param in params:
        grad = param.grad
        (grad.to_local() if isinstance(grad, DTensor) else grad).mul_(scale)
    return norm


def _by_mesh(grads: Iterable[torch.Tensor]) -> dict[object, list[torch.Tensor]]:
    groups: dict[object, list[torch.Tensor]] = {}
    for grad in grads:
        groups.setdefault(grad.device_mesh if isinstance(grad, DTensor) else None, []).append(grad)
    return groups

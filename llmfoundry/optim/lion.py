"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms") with decoupled
weight decay.

Lion steps every coordinate by exactly ±lr (the sign of an interpolation of momentum and
gradient), so it keeps one state tensor per parameter instead of Adam's two, and its updates
are larger: typical lrs are 3-10x smaller than AdamW's and weight decays 3-10x larger. Decay is
scaled by lr / initial_lr, as in `DecoupledAdamW`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from llmfoundry.optim.param_groups import decay_factor, decoupled_groups
from llmfoundry.utils.errors import UserError


class DecoupledLionW(torch.optim.Optimizer):
    """For each parameter with a gradient g and momentum m:

    p <- p * (1 - weight_decay * lr / initial_lr)
    p <- p - lr * sign(beta1 * m + (1 - beta1) * g)
    m <- beta2 * m + (1 - beta2) * g
    """

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter] | Iterable[dict[str, Any]],
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
        no_decay_norm_bias_embedding: bool = False,
    ) -> None:
        if lr <= 0:
            raise UserError(f"optimizer.lr must be positive, got {lr}")
        betas = tuple(betas)
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise UserError(f"optimizer.betas must be two numbers in [0, 1), got {list(betas)}")
        groups = decoupled_groups(params, weight_decay, no_decay_norm_bias_embedding)
        super().__init__(groups, {"lr": lr, "betas": betas})
        for group in self.param_groups:
            group.setdefault("initial_lr", group["lr"])

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (beta1, beta2) = group["lr"], group["betas"]
            factor = decay_factor(group)
            for param in group["params"]:
                grad = param.grad
                if grad is None:
                    continue
                if grad.is_sparse:
                    raise ValueError("DecoupledLionW does not support sparse gradients")
                state = self.state[param]
                if not state:
                    state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                momentum = state["exp_avg"]
                if factor != 1.0:
                    param.mul_(factor)
                param.add_(momentum.lerp(grad, 1.0 - beta1).sign_(), alpha=-lr)
                momentum.lerp_(grad, 1.0 - beta2)
        return loss

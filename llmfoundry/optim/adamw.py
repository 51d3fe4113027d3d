"""AdamW with weight decay decoupled from the learning rate.

torch's AdamW multiplies weight decay by the lr, so a recipe's decay strength changes whenever
its lr does. Here the decay follows only the schedule (lr / initial_lr), as in Loshchilov &
Hutter: ``weight_decay=1e-5`` means the same thing at lr 6e-4 and at lr 1e-4.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class DecoupledAdamW(torch.optim.AdamW):
    def __init__(
        self,
        params: Iterable[torch.nn.Parameter] | Iterable[dict],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ) -> None:
        if lr <= 0:
            raise ValueError(f"optimizer.lr must be positive, got {lr}")
        if weight_decay < 0:
            raise ValueError(f"optimizer.weight_decay must be >= 0, got {weight_decay}")
        super().__init__(params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=0.0)
        for group in self.param_groups:
            group["decoupled_weight_decay"] = weight_decay
            group.setdefault("initial_lr", lr)

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001 - torch's signature
        for group in self.param_groups:
            decay = group["decoupled_weight_decay"]
            if decay == 0:
                continue
            factor = 1.0 - decay * group["lr"] / group["initial_lr"]
            for param in group["params"]:
                if param.grad is not None:
                    param.mul_(factor)
        return super().step(closure)

"""1-bit Adam (Tang et al. 2021, arXiv:2102.02888).

With lr, betas (beta1, beta2), eps, decoupled weight decay wd, bias corrections
b1(t) = 1 - beta1^t and b2(t) = 1 - beta2^t, and T0 = freeze_step:

    warm-up (t <= T0), g = mean over ranks of the gradients (uncompressed):
        m <- beta1 m + (1 - beta1) g
        v <- beta2 v + (1 - beta2) g^2
        w <- w (1 - lr wd) - lr / b1(t) * m / (sqrt(v / b2(t)) + eps)       (= torch.optim.AdamW;
                                                                             torch.optim.Adam when wd = 0)
    compression (t > T0), g_r = this rank's gradient:
        m_r = beta1 m + (1 - beta1) g_r
        m <- compressed_allreduce(m_r)                  1-bit, error feedback per bucket
        w <- w (1 - lr wd) - lr / b1(t) * m / (sqrt(v / b2(T0)) + eps)      v frozen at T0

Freezing v is what lets the momentum, not the gradient, be compressed: with a fixed
preconditioner the update is linear in m, so the error feedback of the compressed momentum
compensates across steps as in compressed SGD with momentum.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from ..backends import Backend
from .base import OnebitOptimizer, adam_denominator, apply_to_param, update_moments


class OnebitAdam(OnebitOptimizer):
    """Adam whose momentum is averaged with the error-compensated 1-bit allreduce after
    `freeze_step` uncompressed warm-up steps (see the module docstring for the math).

    The optimizer performs all gradient communication itself: do not wrap the model in DDP,
    start every rank from the same parameters, and call `step()` on every rank together.
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, freeze_step: int = 100000,
                 backend: Backend | str | None = None) -> None:
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults, freeze_step, backend)

    def _adam_step(self, p: torch.Tensor, group: dict, m: torch.Tensor, v: torch.Tensor,
                   t: int, v_step: int) -> None:
        """w <- w (1 - lr wd) - lr / b1(t) * m / (sqrt(v / b2(v_step)) + eps)."""
        lr, wd, (beta1, beta2) = group["lr"], group["weight_decay"], group["betas"]
        denom = adam_denominator(v, beta2, v_step, group["eps"])

        def update(w: torch.Tensor) -> None:
            if wd:
                w.mul_(1 - lr * wd)
            w.addcdiv_(m, denom, value=-lr / (1 - beta1 ** t))

        apply_to_param(p, update)

    def _warmup_update(self, t: int, grads: Sequence[torch.Tensor]) -> None:
        for p, g, group in zip(self._params(), grads, self._groups_of_params()):
            state = self._moments(p)
            update_moments(state, g, group["betas"])
            self._adam_step(p, group, state["exp_avg"], state["exp_avg_sq"], t, t)

    def _compressed_update(self, t: int, momenta: Sequence[torch.Tensor]) -> None:
        for p, m, group in zip(self._params(), momenta, self._groups_of_params()):
            state = self.state[p]
            state["exp_avg"].copy_(m.view_as(state["exp_avg"]))
            self._adam_step(p, group, state["exp_avg"], state["exp_avg_sq"], t, self.freeze_step)

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
        m <- mask * compressed_allreduce(m_r)           1-bit, error feedback per bucket
        w <- w (1 - lr wd) - lr / b1(t) * m / (sqrt(v / b2(T0)) + eps)      v frozen at T0

    mask = 0 where sqrt(v / b2(T0)) <= eps (the element got no real gradient in warm-up, so the
    frozen preconditioner would amplify the 1-bit noise up to 1/(2 eps)), times the group's
    `exp_avg_mask` if it has one; 1 elsewhere.

Freezing v is what lets the momentum, not the gradient, be compressed: with a fixed
preconditioner the update is linear in m, so the error feedback of the compressed momentum
compensates across steps as in compressed SGD with momentum.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from ..backends import Backend
from .base import COMPRESSED, EXACT, OnebitOptimizer
from .updates import (
    Denominators,
    adam_denominator,
    check_count,
    decoupled_step_,
    mask_,
    master_weight,
    store_,
    update_moments,
)


class FrozenVarianceOptimizer(OnebitOptimizer):
    """Exact gradients for `freeze_step` warm-up steps, then each rank's momentum in 1 bit (times
    a fixed per-parameter scale, `_momentum_scale(p)`, 1 unless a subclass sets one): what
    1-bit Adam and 1-bit LAMB share."""

    _FREEZE_SETTING = "freeze_step"

    def __init__(
        self, params: Iterable, defaults: dict[str, Any], freeze_step: int, backend: Backend | str | None
    ) -> None:
        check_freeze_step(freeze_step)
        super().__init__(params, defaults, backend)
        self.freeze_step = int(freeze_step)
        self._frozen = Denominators()

    def _kind(self, t: int) -> str:
        return EXACT if t <= self.freeze_step else COMPRESSED

    def _switch_step(self) -> int | None:
        return self.freeze_step

    def _schedule(self) -> dict[str, Any]:
        return {"freeze_step": self.freeze_step}

    def _payload_shows_nonfinite(self, kind: str) -> bool:
        return True  # the payload is g, or m_r = beta1 m + (1 - beta1) g (times s_l > 0)

    def _frozen_denominator(self, p: torch.Tensor, group: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """sqrt(v / b2(T0)) + eps and where it is negligible: v no longer changes after the
        freeze, so both are computed once (again after a checkpoint load or a change of eps or
        beta2) instead of in every step."""
        return self._frozen.get(p, self._moments(p)["exp_avg_sq"], self.freeze_step, group)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._frozen.clear()
        super().load_state_dict(state_dict)

    def _momentum_scale(self, p: torch.Tensor) -> float:
        return 1.0

    def _payload(
        self, t: int, kind: str, p: torch.Tensor, group: dict[str, Any], g: torch.Tensor, out: torch.Tensor
    ) -> None:
        if kind == EXACT:
            out.copy_(g)
            return
        torch.lerp(self._moments(p)["exp_avg"], g, 1 - group["betas"][0], out=out)  # m_r
        scale = self._momentum_scale(p)
        if scale != 1.0:
            out.mul_(scale)


class OnebitAdam(FrozenVarianceOptimizer):
    """Adam whose momentum is averaged with the error-compensated 1-bit allreduce after
    `freeze_step` uncompressed warm-up steps (the math: `compcomm.optim.adam`'s module docstring).

    The optimizer performs all gradient communication itself: do not wrap the model in DDP,
    start every rank from the same parameters, and call `step()` on every rank together.
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        freeze_step: int = 100000,
        backend: Backend | str | None = None,
    ) -> None:
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults, freeze_step, backend)

    def _apply(self, t: int, kind: str, values: Sequence[torch.Tensor]) -> None:
        for p, value, group, state in self._entries(values):
            state = self._moments(p)
            beta1, beta2 = group["betas"]
            if kind == EXACT:
                update_moments(state, value, group["betas"])
                denom = adam_denominator(state["exp_avg_sq"], beta2, t, group["eps"], out=self._scratch_like(p))
            else:
                denom, masked = self._frozen_denominator(p, group)
                mask_(value, p, group, masked, out=state["exp_avg"])
            w = master_weight(p, state)
            decoupled_step_(w, group, state["exp_avg"], denom, group["lr"] / (1 - beta1**t))
            store_(p, w)


def check_freeze_step(freeze_step: Any) -> None:
    """ValueError unless freeze_step >= 1 (the compressed stage needs a warm-up estimate of v)."""
    try:
        check_count("freeze_step", freeze_step, 1)
    except ValueError as exc:
        raise ValueError(f"{exc}: the compression stage needs a second moment estimated during warm-up") from None

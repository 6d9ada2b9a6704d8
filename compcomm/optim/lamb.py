"""1-bit LAMB (Li et al. 2021, arXiv:2104.06069).

Per layer l (one parameter tensor w) with the Adam quantities of `adam.py` (bias-corrected
m_hat = m / b1(t), denominators d(v, s) = sqrt(v / b2(s)) + eps, T0 = freeze_step):

    warm-up (t <= T0), g = mean over ranks of the gradients (uncompressed):
        m, v updated as in Adam
        u = m_hat / d(v, t) + wd w
        c = clamp(||w|| / ||u||, min_coeff, max_coeff)        (c = 1 when a norm is 0)
        w <- w - lr c u
        c_avg <- coeff_beta c_avg + (1 - coeff_beta) c         (starts at the first defined c)
    end of warm-up (t = T0):
        c_frz = c_avg (1 when never defined); v_fresh = v; factor_last = 1
        s_l = mean_k(rms(m_k)) / rms(m_l)                     fixed per-layer momentum scales,
                                                              from the (synchronized) momentum
    compression (t > T0), g_r = this rank's gradient, m_prev = the synchronized momentum:
        m_r = beta1 m_prev + (1 - beta1) g_r
        m = mask * compressed_allreduce(m_r * s_l) / s_l      one 1-bit collective per bucket
                                                              (mask as in 1-bit Adam)
        g_rec = (m - beta1 m_prev) / (1 - beta1)              the gradient the update "saw"
        v_fresh <- beta2 v_fresh + (1 - beta2) g_rec^2        v itself stays frozen
        u_pre = m_hat / d(v, T0);  u = u_pre + wd w
        f = max_i( d(v, T0)_i / d(v_fresh, t)_i )             how far the frozen preconditioner lags
        if wd > 0:  r = min(1, ||u_pre|| / ||u||);  f = r f + (1 - r)
        f = clamp(f, factor_min, factor_max)
        f = clamp(f, factor_last (1 - factor_threshold), factor_last (1 + factor_threshold));
        factor_last = f
        c = clamp(c_frz f, min_coeff, max_coeff)
        w <- w - lr c u

The momentum scales s_l equalize the layers' magnitudes so that one 1-bit scale per chunk of a
bucket fits them all; they are computed once from the averaged momentum, so they are the same
on every rank and the rescaled result stays bitwise identical everywhere.

On FSDP2-sharded parameters (`compcomm.fsdp`) the gradients arrive reduced, 1-bit after the
switch, so no momentum is compressed: s_l = 1, g_rec is that gradient, and the norms and the
maximum above are taken over each parameter's shards (one small all-reduce each).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from ..backends import Backend
from .adam import FrozenVarianceOptimizer
from .base import EXACT
from .updates import adam_denominator, check_range, mask_, master_weight, store_, update_moments


def trust_ratio(w_norm: float, u_norm: float) -> float | None:
    """||w|| / ||u||, or None when either norm is 0 (the ratio is undefined)."""
    if w_norm == 0.0 or u_norm == 0.0 or not math.isfinite(w_norm / u_norm):
        return None
    return w_norm / u_norm


def clamp(x: float, low: float, high: float) -> float:
    return min(max(x, low), high)


def warmup_coefficient(
    ratio: float | None, coeff_avg: float | None, group: dict[str, Any]
) -> tuple[float, float | None]:
    """The warm-up coefficient c = clamp(ratio) (1 when undefined) and the new running average."""
    if ratio is None:
        return 1.0, coeff_avg
    c = clamp(ratio, group["min_coeff"], group["max_coeff"])
    beta = group["coeff_beta"]
    return c, c if coeff_avg is None else beta * coeff_avg + (1 - beta) * c


def compressed_factor(
    variance_ratio: float, last: float, norms: tuple[float, float] | None, group: dict[str, Any]
) -> float:
    """The factor f of the compression stage (module docstring), from max(d(v, T0) / d(v_fresh, t));
    `norms` = (||u_pre||, ||u||) are needed only with weight decay."""
    factor = variance_ratio
    if group["weight_decay"] and norms is not None:
        u_pre_norm, u_norm = norms
        r = min(1.0, u_pre_norm / u_norm) if u_norm > 0 else 1.0
        factor = r * factor + (1.0 - r)
    factor = clamp(factor, group["factor_min"], group["factor_max"])
    thr = group["factor_threshold"]
    return clamp(factor, last * (1.0 - thr), last * (1.0 + thr))


class OnebitLamb(FrozenVarianceOptimizer):
    """LAMB whose momentum is averaged with the error-compensated 1-bit allreduce after
    `freeze_step` warm-up steps, with frozen, variance-adapted layer-wise coefficients
    (the math: `compcomm.optim.lamb`'s module docstring).

    The optimizer performs all gradient communication itself: do not wrap the model in DDP,
    start every rank from the same parameters, and call `step()` on every rank together.
    """

    _HELD_FROM_START = ("exp_avg_sq_fresh",)  # v_fresh, filled at the freeze

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        freeze_step: int = 100000,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        coeff_beta: float = 0.9,
        factor_max: float = 4.0,
        factor_min: float = 0.5,
        factor_threshold: float = 0.1,
        backend: Backend | str | None = None,
    ) -> None:
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            max_coeff=max_coeff,
            min_coeff=min_coeff,
            coeff_beta=coeff_beta,
            factor_max=factor_max,
            factor_min=factor_min,
            factor_threshold=factor_threshold,
        )
        super().__init__(params, defaults, freeze_step, backend)

    def _check_group(self, group: dict[str, Any]) -> None:
        super()._check_group(group)
        check_range("min_coeff", group["min_coeff"], 0.0, low_open=True)
        check_range("max_coeff", group["max_coeff"], group["min_coeff"])
        check_range("coeff_beta", group["coeff_beta"], 0.0, 1.0, high_open=True)
        check_range("factor_min", group["factor_min"], 0.0, 1.0, low_open=True)
        check_range("factor_max", group["factor_max"], 1.0)
        check_range("factor_threshold", group["factor_threshold"], 0.0)

    def _momentum_scale(self, p: torch.Tensor) -> float:
        return self.state[p]["momentum_scale"]  # s_l, fixed at the freeze

    def _apply(self, t: int, kind: str, values: Sequence[torch.Tensor]) -> None:
        for p, value, group, state in self._entries(values):
            if kind == EXACT:
                self._warmup_update(t, p, value, group, self._moments(p))
            else:
                self._compressed_update(t, p, value.div_(state["momentum_scale"]), group, state)
        if kind == EXACT and t == self.freeze_step:
            self._freeze()

    def _warmup_update(
        self, t: int, p: torch.Tensor, g: torch.Tensor, group: dict[str, Any], state: dict[str, Any]
    ) -> None:
        """u_pre = m_hat / d(v, t) computed as k q with q = m / (sqrt(v) + eps sqrt(b2(t))) and
        k = sqrt(b2(t)) / b1(t): the same value in three passes fewer (the bias corrections
        folded into scalars), and one temporary."""
        beta1, beta2 = group["betas"]
        update_moments(state, g, group["betas"])
        root_b2 = math.sqrt(1 - beta2**t)
        k = root_b2 / (1 - beta1**t)
        q = torch.sqrt(state["exp_avg_sq"], out=self._scratch_like(p)).add_(group["eps"] * root_b2)
        q = torch.div(state["exp_avg"], q, out=q)
        w = master_weight(p, state)
        if group["weight_decay"]:
            u = q.mul_(k).add_(w, alpha=group["weight_decay"])
            ratio, step = trust_ratio(*self._norms(p, [w, u])), group["lr"]
        else:  # u = k q: ||w|| / ||u|| = (||w|| / ||q||) / k, and k goes into the step
            u, ratio, step = q, trust_ratio(*self._norms(p, [w, q])), group["lr"] * k
            ratio = None if ratio is None else ratio / k
        c, state["coeff_avg"] = warmup_coefficient(ratio, state.get("coeff_avg"), group)
        w.add_(u, alpha=-step * c)
        store_(p, w)

    @staticmethod
    def _weight_decayed(u_pre: torch.Tensor, w: torch.Tensor, group: dict[str, Any], out: torch.Tensor) -> torch.Tensor:
        """u = u_pre + wd w (written into `out`), or u_pre itself when wd = 0."""
        wd = group["weight_decay"]
        return torch.add(u_pre, w, alpha=wd, out=out) if wd else u_pre

    def _freeze(self) -> None:
        params = self._params()
        rms = [self._norms(p, [self._moments(p)["exp_avg"]])[0] / math.sqrt(max(p.numel(), 1)) for p in params]
        positive = [r for r in rms if r > 0.0 and math.isfinite(r)]
        united = sum(positive) / len(positive) if positive else 1.0
        for p, r in zip(params, rms):
            state = self.state[p]
            state["coeff_frozen"] = state.get("coeff_avg") or 1.0
            state["exp_avg_sq_fresh"].copy_(state["exp_avg_sq"])
            state["last_factor"] = 1.0
            sendable = self._sharded is None and r > 0.0 and math.isfinite(united / r)
            state["momentum_scale"] = united / r if sendable else 1.0

    def _compressed_update(
        self, t: int, p: torch.Tensor, m: torch.Tensor, group: dict[str, Any], state: dict[str, Any]
    ) -> None:
        beta1, beta2 = group["betas"]
        denom, masked = self._frozen_denominator(p, group)
        m = mask_(m, p, group, masked)
        scratch = self._scratch_like(p, 0)
        # g_rec = (m - beta1 m_prev) / (1 - beta1): the division is folded into the addcmul's value
        delta = torch.add(m, state["exp_avg"], alpha=-beta1, out=scratch)
        fresh = state["exp_avg_sq_fresh"].mul_(beta2).addcmul_(delta, delta, value=(1 - beta2) / (1 - beta1) ** 2)
        state["exp_avg"].copy_(m)
        fresh_denom = adam_denominator(fresh, beta2, t, group["eps"], out=scratch)
        ratios = torch.div(denom, fresh_denom, out=scratch)
        variance_ratio = self._max(p, float(ratios.max()) if ratios.numel() else 0.0)  # a shard may be empty
        w = master_weight(p, state)
        if group["weight_decay"]:
            u_pre = torch.div(state["exp_avg"], 1 - beta1**t, out=self._scratch_like(p, 1)).div_(denom)
            u = self._weight_decayed(u_pre, w, group, out=scratch)
            norms = self._norms(p, [u_pre, u])
            state["last_factor"] = compressed_factor(variance_ratio, state["last_factor"], (norms[0], norms[1]), group)
            w.add_(u, alpha=-group["lr"] * self._compressed_coefficient(state, group))
        else:  # u = m_hat / d in one pass, the bias correction folded into the step size
            state["last_factor"] = compressed_factor(variance_ratio, state["last_factor"], None, group)
            step = group["lr"] * self._compressed_coefficient(state, group) / (1 - beta1**t)
            w.addcdiv_(state["exp_avg"], denom, value=-step)
        store_(p, w)

    @staticmethod
    def _compressed_coefficient(state: dict[str, Any], group: dict[str, Any]) -> float:
        """c = clamp(c_frz f, min_coeff, max_coeff)."""
        return clamp(state["coeff_frozen"] * state["last_factor"], group["min_coeff"], group["max_coeff"])

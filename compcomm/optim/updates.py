"""Element-wise pieces the update rules share: moments, Adam denominators, masks, fp32 masters."""
from __future__ import annotations

import math
import numbers
from typing import Any

import torch

PARAM_DTYPES = (torch.float32, torch.bfloat16)


def check_range(name: str, value: Any, low: float, high: float = math.inf, *,
                low_open: bool = False, high_open: bool = False) -> None:
    """ValueError unless `value` is a finite real number within the given bounds."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
    if not ok:
        lo, hi = "(" if low_open else "[", ")" if high_open or high == math.inf else "]"
        raise ValueError(f"invalid {name}: {value!r} (must be a finite number in {lo}{low}, {high}{hi})")


def check_count(name: str, value: Any, low: int) -> None:
    """ValueError unless `value` is an integer >= low."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise ValueError(f"invalid {name}: {value!r} (must be an integer >= {low})")


def update_moments(state: dict[str, Any], grad: torch.Tensor, betas: tuple[float, float]) -> None:
    """m <- beta1 m + (1 - beta1) g;  v <- beta2 v + (1 - beta2) g^2  (fp32, in place)."""
    beta1, beta2 = betas
    state["exp_avg"].lerp_(grad, 1 - beta1)
    state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)


def adam_denominator(exp_avg_sq: torch.Tensor, beta2: float, step: int, eps: float) -> torch.Tensor:
    """sqrt(v / (1 - beta2^step)) + eps, as torch.optim.Adam computes it (a new tensor)."""
    return (exp_avg_sq.sqrt() / math.sqrt(1 - beta2 ** step)).add_(eps)


def negligible(denominator: torch.Tensor, eps: float) -> torch.Tensor:
    """Where the bias-corrected sqrt(v) is at most eps: the element got no real gradient while
    v was estimated, so a frozen preconditioner would amplify 1-bit noise by up to 1/(2 eps).
    `denominator` is `adam_denominator(...)`, i.e. sqrt(v_hat) + eps."""
    return denominator <= 2 * eps


def mask_(values: torch.Tensor, group: dict[str, Any], denominator: torch.Tensor,
          negligible_: torch.Tensor | None = None) -> torch.Tensor:
    """Zero, in place, the elements of a communicated momentum that must not move the weights:
    the automatic rule (`negligible`, or its value `negligible_` when already known) and the
    group's `exp_avg_mask` (1 keeps, 0 masks)."""
    values.masked_fill_(negligible(denominator, group["eps"]) if negligible_ is None else negligible_, 0.0)
    user = group.get("exp_avg_mask")
    if user is not None:
        values.mul_(user.to(values.device))
    return values


def master_weight(p: torch.Tensor, state: dict[str, Any]) -> torch.Tensor:
    """The fp32 value of `p` to update in place: the parameter itself, or for a bfloat16
    parameter its fp32 master copy `state["master"]` (made on first use, checkpointed with
    the state), so that updates smaller than bf16's spacing accumulate instead of being lost.
    `store_` writes it back."""
    if p.dtype == torch.float32:
        return p.detach()
    if "master" not in state:
        state["master"] = p.detach().float().clone()
    return state["master"]


def store_(p: torch.Tensor, w: torch.Tensor) -> None:
    """Write the updated fp32 value `w` (from `master_weight`) back into `p` (bf16: rounded)."""
    if p.dtype != torch.float32:
        p.detach().copy_(w)


def decoupled_step_(w: torch.Tensor, group: dict[str, Any], direction: torch.Tensor, denominator: torch.Tensor,
                    step_size: float) -> None:
    """w <- w (1 - lr wd) - step_size * direction / denominator  (AdamW's update, in place)."""
    wd = group["weight_decay"]
    if wd:
        w.mul_(1 - group["lr"] * wd)
    w.addcdiv_(direction, denominator, value=-step_size)

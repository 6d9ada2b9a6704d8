"""Element-wise pieces the update rules share: moments, Adam denominators, masks, fp32 masters.

They work in place or into a given `out=` tensor: on a CPU, a fresh tensor of a large
parameter's size costs more (the allocator hands back new pages, each faulted in on first
touch) than the arithmetic that fills it, so the optimizers reuse buffers instead.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch

from ..layout import is_integer
from .shards import local, local_part

PARAM_DTYPES = (torch.float32, torch.bfloat16)


def check_range(
    name: str, value: Any, low: float, high: float = math.inf, *, low_open: bool = False, high_open: bool = False
) -> None:
    """ValueError unless `value` is a finite real number within the given bounds."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
    if not ok:
        lo, hi = "(" if low_open else "[", ")" if high_open or high == math.inf else "]"
        kind = f"a {type(value).__name__} is not taken: " if torch.is_tensor(value) or isinstance(value, bool) else ""
        raise ValueError(f"invalid {name}: {value!r} ({kind}must be a finite number in {lo}{low}, {high}{hi})")


def check_count(name: str, value: Any, low: int) -> None:
    """ValueError unless `value` is an integer >= low."""
    if not is_integer(value) or value < low:
        raise ValueError(f"invalid {name}: {value!r} (must be an integer >= {low})")


def update_moments(state: dict[str, Any], grad: torch.Tensor, betas: tuple[float, float]) -> None:
    """m <- beta1 m + (1 - beta1) g;  v <- beta2 v + (1 - beta2) g^2  (fp32, in place)."""
    beta1, beta2 = betas
    state["exp_avg"].lerp_(grad, 1 - beta1)
    state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)


def adam_denominator(
    exp_avg_sq: torch.Tensor, beta2: float, step: int, eps: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """sqrt(v / (1 - beta2^step)) + eps, with torch.optim.Adam's operations (so its rounding),
    written into `out` (a new tensor if None)."""
    return torch.sqrt(exp_avg_sq, out=out).div_(math.sqrt(1 - beta2**step)).add_(eps)


def negligible(denominator: torch.Tensor, eps: float) -> torch.Tensor:
    """Where the bias-corrected sqrt(v) is at most eps: the element got no real gradient while
    v was estimated, so a frozen preconditioner would amplify 1-bit noise by up to 1/(2 eps).
    `denominator` is `adam_denominator(...)`, i.e. sqrt(v_hat) + eps."""
    return denominator <= 2 * eps


def mask_(
    values: torch.Tensor,
    p: torch.Tensor,
    group: dict[str, Any],
    masked: torch.Tensor | None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The elements of parameter p's communicated momentum that must not move its weights
    zeroed: those `masked` (by the automatic rule, `negligible`, in the form `sparse_mask` gives:
    None when no element is, the flat indices of the few masked elements, or keep bits for many)
    and by the group's `exp_avg_mask` (1 keeps, 0 masks; shaped for the whole parameter, so its
    part on p's shard where p is sharded). In place, or written into `out`."""
    if masked is not None and masked.dtype not in (torch.int8, torch.int64):
        raise TypeError(f"mask_ takes the form sparse_mask gives (int8 keep bits or int64 indices), not {masked.dtype}")
    target = values if out is None else out
    if masked is not None and masked.dtype != torch.int8 and not target.is_contiguous():
        dense = torch.zeros(target.numel(), dtype=torch.bool, device=target.device)
        masked = keep_bits(dense.index_fill_(0, masked, True)).view(target.shape)
    if masked is not None and masked.dtype == torch.int8:
        # AND with all-ones or all-zeros bits: a masked element becomes exactly +0.0 (NaN included),
        # and a kept one keeps its bits; ~10x faster on a CPU than masked_fill_ or torch.where, and
        # one pass into `out` (no copy first)
        source = values if out is None or out.dtype == values.dtype else out.copy_(values)
        ints = _SAME_SIZE_INT[target.element_size()]
        torch.bitwise_and(source.view(ints), masked, out=target.view(ints))
    else:
        if out is not None:
            out.copy_(values)
        if masked is not None:
            target.view(-1).index_fill_(0, masked, 0.0)  # costs only the few masked elements
    user = group.get("exp_avg_mask")
    if user is not None:
        target.mul_(local_part(p, user.to(target.device)))
    return target


_SAME_SIZE_INT = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def keep_bits(masked: torch.Tensor) -> torch.Tensor:
    """A bool mask as int8 keep bits: 0 where masked, -1 (all ones, and all ones again once
    widened to the values' integer width) where kept; as small as the bool mask."""
    return masked.to(torch.int8).sub_(1)


def sparse_mask(masked: torch.Tensor) -> torch.Tensor | None:
    """A bool mask in the form `mask_` applies fastest: None when nothing is masked, the flat
    indices of the masked elements when they are few (one in 16 or fewer), else `keep_bits`."""
    count = int(masked.sum())
    if count == 0:
        return None
    return masked.view(-1).nonzero().view(-1) if 16 * count <= masked.numel() else keep_bits(masked)


class Denominators:
    """Adam denominators sqrt(v / (1 - beta2^k)) + eps and where they are `negligible` (as
    `sparse_mask` gives it, so that masking costs little; worked out on first request), per
    parameter, kept while v does not change: the frozen stage of 1-bit Adam/LAMB (k = the
    freeze step) and 0/1 Adam between variance refreshes (k = the refresh count) reuse them
    instead of recomputing three passes over v each step. An entry is recomputed when its
    key (k, eps, beta2) changes; `clear()` after anything else replaces v (a checkpoint load).
    Kept beside the optimizer state, not in it: derived from it."""

    def __init__(self) -> None:
        self._entries: dict[torch.Tensor, list[Any]] = {}  # p -> [key, denominator, mask, mask known]

    def denominator(self, p: torch.Tensor, exp_avg_sq: torch.Tensor, k: int, group: dict[str, Any]) -> torch.Tensor:
        """The denominator of parameter p, whose second moment is `exp_avg_sq`."""
        key = (k, group["eps"], group["betas"][1])
        entry = self._entries.get(p)
        if entry is None or entry[0] != key:
            out = entry[1] if entry is not None else None
            entry = self._entries[p] = [key, adam_denominator(exp_avg_sq, key[2], k, key[1], out=out), None, False]
        return entry[1]

    def get(
        self, p: torch.Tensor, exp_avg_sq: torch.Tensor, k: int, group: dict[str, Any]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(denominator, negligible) of parameter p, whose second moment is `exp_avg_sq`."""
        denom = self.denominator(p, exp_avg_sq, k, group)
        entry = self._entries[p]
        if not entry[3]:
            entry[2], entry[3] = sparse_mask(negligible(denom, group["eps"])), True
        return denom, entry[2]

    def clear(self) -> None:
        self._entries.clear()


def master_weight(p: torch.Tensor, state: dict[str, Any]) -> torch.Tensor:
    """The fp32 value of `p` (its local shard) to update in place: the parameter itself, or for
    a bfloat16 parameter its fp32 master copy `state["master"]` (made on first use, checkpointed
    with the state), so that updates smaller than bf16's spacing accumulate instead of being
    lost. `store_` writes it back."""
    if p.dtype == torch.float32:
        return local(p).detach()
    if "master" not in state:
        state["master"] = local(p).detach().float().clone()
    return state["master"]


def store_(p: torch.Tensor, w: torch.Tensor) -> None:
    """Write the updated fp32 value `w` (from `master_weight`) back into `p` (bf16: rounded)."""
    if p.dtype != torch.float32:
        local(p).detach().copy_(w)


def decoupled_step_(
    w: torch.Tensor,
    group: dict[str, Any],
    direction: torch.Tensor,
    denominator: torch.Tensor,
    step_size: float,
    out: torch.Tensor | None = None,
) -> None:
    """w (1 - lr wd) - step_size * direction / denominator  (AdamW's update), in place, or
    written into `out` (w unchanged) with the same operations, without copying w first."""
    wd = group["weight_decay"]
    if wd:
        w = w.mul_(1 - group["lr"] * wd) if out is None else torch.mul(w, 1 - group["lr"] * wd, out=out)
    torch.addcdiv(w, direction, denominator, value=-step_size, out=w if out is None else out)

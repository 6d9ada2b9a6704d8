"""Exceptions raised identically on every rank of a failed collective, and the check behind them."""

import math

import torch


class NonFiniteError(FloatingPointError):
    """Some rank's input (plus its carried error) held NaN or Inf.

    Raised on every rank from the same call, before any tensor or error state changes,
    so the caller can skip the step everywhere alike.
    """


def largest_magnitude(tensor: torch.Tensor) -> float:
    """max |x| in one pass with no temporary (0 for an empty tensor); NaN if any element is NaN,
    since min and max both propagate it."""
    if tensor.numel() == 0:
        return 0.0
    low, high = torch.aminmax(tensor.detach())
    return max(-float(low), float(high))


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether every element is finite (isfinite().all() makes a bool tensor and runs ~10x slower)."""
    return math.isfinite(largest_magnitude(tensor))

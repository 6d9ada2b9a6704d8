"""Exceptions raised identically on every rank of a failed collective, and the check behind them."""
import math

import torch


class NonFiniteError(FloatingPointError):
    """Some rank's input (plus its carried error) held NaN or Inf.

    Raised on every rank from the same call, before any tensor or error state changes,
    so the caller can skip the step everywhere alike.
    """


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether every element is finite, in one pass with no temporary (isfinite().all() makes a
    bool tensor and runs ~10x slower); min and max propagate NaN, and an inf is one of them."""
    if tensor.numel() == 0:
        return True
    low, high = torch.aminmax(tensor.detach())
    return math.isfinite(float(low)) and math.isfinite(float(high))

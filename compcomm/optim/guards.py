"""Misuses of the compcomm optimizers that would otherwise train silently wrong or slow.

A compcomm optimizer does all gradient communication itself. Given the parameters of a model
wrapped in DistributedDataParallel, every step would pay DDP's fp32 all-reduce in backward and
then its own: correct numbers, twice the traffic, no word. DDP does not mark the parameters it
holds, so the check looks for the DDP module that keeps them: the list DDP stores them in
(`_module_parameters`), found through the garbage collector's referrers of one parameter, once,
when the optimizer is built.
"""

from __future__ import annotations

import gc
from collections.abc import Sequence

import torch


def wrapped_by_ddp(params: Sequence[torch.Tensor]) -> bool:
    """Whether a DistributedDataParallel module holds these parameters."""
    trained = next((p for p in params if p.requires_grad), None)
    if trained is None:
        return False
    for holder in gc.get_referrers(trained):
        if not isinstance(holder, list):
            continue
        for owner in gc.get_referrers(holder):
            if isinstance(owner, dict) and owner.get("_module_parameters") is holder and "reducer" in owner:
                return True
    return False


def refuse_ddp(params: Sequence[torch.Tensor], who: str) -> None:
    """ValueError when `params` belong to a DDP-wrapped model."""
    if wrapped_by_ddp(params):
        raise ValueError(
            f"{who} got the parameters of a model wrapped in DistributedDataParallel: {who} averages the "
            "gradients itself, so DDP's all-reduce would run too, every step. Give it the unwrapped model's "
            "parameters (model.module.parameters() or the model before wrapping, and do not wrap it)"
        )

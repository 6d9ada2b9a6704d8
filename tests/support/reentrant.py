"""Training steps under reentrant activation checkpointing and a GradScaler, for the tests of
how the optimizers and DiLoCo see backward passes that autograd runs nested in another."""

from __future__ import annotations

import warnings

import torch


def through_reentrant_checkpoints(model: torch.nn.Sequential, h: torch.Tensor) -> torch.Tensor:
    """`model` on `h`, each Linear under reentrant checkpointing: its gradients come in a
    backward nested in the one that reaches it (`h` must require grad for them to come)."""
    from torch.utils.checkpoint import checkpoint

    for layer in model:
        h = checkpoint(layer, h, use_reentrant=True) if isinstance(layer, torch.nn.Linear) else layer(h)
    return h


def scaled_step(scaler: torch.amp.GradScaler, opt: torch.optim.Optimizer) -> None:
    """`scaler.step(opt)`, its warnings (an optimizer that unscales itself) silenced, then
    `scaler.update()`."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scaler.step(opt)
    scaler.update()

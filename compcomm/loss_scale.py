"""Carried errors that follow a GradScaler's loss scale.

A hook that compresses gradients as backward makes them (the DDP hook, FSDP's reduce-scatters)
sees them multiplied by the loss scale s, so the errors it carries to the next backward are in
units of s too. GradScaler halves s after an overflow and doubles it every `growth_interval`
steps; errors carried across such a change would count it once too much or too little. Given
the scaler, the hook reads s once per compressed backward and multiplies the carried errors by
s_new / s_old when it changed (`ErrorFeedback.rescale_`). The code is scale-equivariant and the
ratio a power of two, so the run is bitwise the one whose loss was never scaled, as long as
nothing overflows or underflows.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from .error_feedback import ErrorFeedback


def check_grad_scaler(grad_scaler: object) -> None:
    """TypeError unless `grad_scaler` is a torch.amp.GradScaler (ShardedGradScaler is one) or None."""
    if grad_scaler is not None and not isinstance(grad_scaler, torch.amp.GradScaler):
        raise TypeError(f"grad_scaler must be a torch.amp.GradScaler or None, got {type(grad_scaler).__name__}")


ERRORS_SCALE = "errors_scale"
"""The state dicts' key for the scale their errors are in."""
_LOWEST, _HIGHEST = 2.0**-126, 2.0**127
"""The scales errors may be kept in: fp32's normal range, so that a ratio of two of them leaves
finite errors finite (a GradScaler's scale stays far inside it)."""


class LossScale:
    """The loss scale the kept errors are in (`value`; None: unscaled, also before the first
    compressed backward), and their rescaling when it changes. Without a scaler the gradients
    are unscaled: errors kept under one (a checkpoint of a run that had a scaler) are brought
    back to scale 1."""

    def __init__(self, grad_scaler: torch.amp.GradScaler | None) -> None:
        check_grad_scaler(grad_scaler)
        self.grad_scaler = grad_scaler
        self.value: float | None = None
        self._unread = False
        self._assumed = False  # errors loaded from a state that did not say their scale

    def load(self, state: dict) -> None:
        """The scale of a state dict's errors (`saved` checked it). A state saved before the
        scale was kept does not say it: its errors are taken to be in the scale of the next
        backward (exact unless the scale changed between the save and that backward)."""
        self.value = state.get(ERRORS_SCALE)
        self._assumed = ERRORS_SCALE not in state

    def new_backward(self) -> None:
        """A backward began: its first compressed reduction reads the scale (`follow`)."""
        self._unread = True

    def follow(self, kept: Iterable[ErrorFeedback]) -> None:
        """Once per backward, before its first compressed reduction: put the `kept` errors in
        the units of the scale this backward runs under. Whether the backward then succeeds or
        not, the rescaled errors are what the next one under this scale expects. A scale out of
        range (a scaler that backed off to 0) is not followed: that run only skips steps."""
        if not self._unread:
            return
        self._unread = False
        if self.grad_scaler is None:
            scale = 1.0
        else:
            scale = float(self.grad_scaler.get_scale())  # on CUDA, a synchronization with the device
            if not _LOWEST <= scale <= _HIGHEST:
                return
        if scale != (self.value or 1.0) and not self._assumed:
            for errors in kept:
                errors.rescale_(scale / (self.value or 1.0))
        self.value, self._assumed = (None if self.grad_scaler is None else scale), False

    @staticmethod
    def saved(value: object) -> float | None:
        """A state dict's scale, checked: a float in fp32's normal range, or None (unscaled; also
        for states saved before it was kept)."""
        if value is not None and not (isinstance(value, float) and _LOWEST <= value <= _HIGHEST):
            raise ValueError(f"the state's errors_scale must be None or a float in [2^-126, 2^127], got {value!r}")
        return value

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


class LossScale:
    """The loss scale the kept errors are in (`value`, None until the first compressed backward
    with a scaler), and their rescaling when the scaler's has changed."""

    def __init__(self, grad_scaler: torch.amp.GradScaler | None) -> None:
        check_grad_scaler(grad_scaler)
        self.grad_scaler = grad_scaler
        self.value: float | None = None
        self._unread = False

    def new_backward(self) -> None:
        """A backward began: its first compressed reduction reads the scale (`follow`)."""
        self._unread = self.grad_scaler is not None

    def follow(self, kept: Iterable[ErrorFeedback]) -> None:
        """Once per backward, before its first compressed reduction: put the `kept` errors in
        the units of the scale this backward runs under. Whether the backward then succeeds or
        not, the rescaled errors are what the next one under this scale expects."""
        if not self._unread or self.grad_scaler is None:
            return
        self._unread = False
        scale = float(self.grad_scaler.get_scale())  # on CUDA, a synchronization with the device
        if self.value is not None and scale != self.value:
            for errors in kept:
                errors.rescale_(scale / self.value)
        self.value = scale

    @staticmethod
    def saved(value: object) -> float | None:
        """A state dict's scale, checked: a float > 0, or None (also for states saved before it
        was kept)."""
        if value is not None and not (isinstance(value, float) and value > 0):
            raise ValueError(f"the state's errors_scale must be a float > 0 or None, got {value!r}")
        return value

"""Page-locked host staging buffers for transports that cannot read device memory.

An MPI that is not CUDA-aware gets CUDA tensors through these: device -> pinned host -> MPI
-> pinned host -> device. Buffers are kept and reused across calls (sized to powers of two),
so steady training allocates none.
"""

from __future__ import annotations

import torch


class PinnedPool:
    """Page-locked host byte buffers, reused across calls; one per collective in flight."""

    def __init__(self) -> None:
        self.free: list[torch.Tensor] = []
        self.allocated = 0  # how many buffers were ever made (reuse shows as a small number)

    def take(self, nbytes: int) -> torch.Tensor:
        """The smallest free buffer of at least `nbytes`, or a new one. Found by index: a list's
        `remove` compares tensors with ==, elementwise."""
        fits = [i for i, b in enumerate(self.free) if b.numel() >= nbytes]
        if fits:
            return self.free.pop(min(fits, key=lambda i: self.free[i].numel()))
        size = 1 << max(12, (max(nbytes, 1) - 1).bit_length())
        self.allocated += 1
        return torch.empty(size, dtype=torch.uint8, pin_memory=True)

    def give(self, buf: torch.Tensor) -> None:
        self.free.append(buf)

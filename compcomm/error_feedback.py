"""Persistent error-feedback state of one repeatedly reduced tensor."""
from __future__ import annotations

from typing import Any

import torch

from .layout import chunk_size, padded_size


class ErrorFeedback:
    """The worker and server compression errors carried from one call to the next.

    `worker_error` (fp32, (M,)) holds what this rank's 1-bit code of its input left out;
    `server_error` (fp32, (C,)) what the code of its served chunk of the average left out.
    Both are None until the first successful call, which sizes them for its (numel, world
    size); using the instance for another numel or world size is a ValueError, because the
    carried errors would belong to other elements. Checkpoint it with `state_dict()`.
    """

    def __init__(self) -> None:
        self.worker_error: torch.Tensor | None = None
        self.server_error: torch.Tensor | None = None
        self.numel: int | None = None
        self.world_size: int | None = None

    @property
    def initialized(self) -> bool:
        return self.worker_error is not None

    def mismatch(self, numel: int, world_size: int) -> str | None:
        """Why this state cannot serve a call of (numel, world_size), or None if it can."""
        if not self.initialized or (self.numel, self.world_size) == (numel, world_size):
            return None
        return (f"this ErrorFeedback holds errors of a {self.numel}-element tensor over "
                f"{self.world_size} ranks, not {numel} elements over {world_size}; use one "
                "ErrorFeedback per reduced tensor (or reset() it)")

    def buffers(self, numel: int, world_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The (worker, server) error tensors on `device`, allocated as zeros on first use."""
        if not self.initialized:
            self.worker_error = torch.zeros(padded_size(numel, world_size), dtype=torch.float32, device=device)
            self.server_error = torch.zeros(chunk_size(numel, world_size), dtype=torch.float32, device=device)
            self.numel, self.world_size = numel, world_size
        elif self.worker_error.device != device:
            self.worker_error = self.worker_error.to(device)
            self.server_error = self.server_error.to(device)
        return self.worker_error, self.server_error

    def reset(self) -> None:
        """Forget the carried errors (the next call starts from zero)."""
        self.__init__()

    def state_dict(self) -> dict[str, Any]:
        return {"worker_error": self.worker_error, "server_error": self.server_error,
                "numel": self.numel, "world_size": self.world_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore errors saved by `state_dict()`; they are moved to the tensor's device on use."""
        worker, server = state.get("worker_error"), state.get("server_error")
        numel, world = state.get("numel"), state.get("world_size")
        if worker is None and server is None:
            self.reset()
            return
        if worker is None or server is None or numel is None or world is None:
            raise ValueError("ErrorFeedback state needs worker_error, server_error, numel and world_size")
        if tuple(worker.shape) != (padded_size(numel, world),) or \
                tuple(server.shape) != (chunk_size(numel, world),):
            raise ValueError(f"ErrorFeedback state has shapes {tuple(worker.shape)}/{tuple(server.shape)}, "
                             f"which do not fit {numel} elements over {world} ranks")
        self.worker_error = worker.detach().to(torch.float32).clone()
        self.server_error = server.detach().to(torch.float32).clone()
        self.numel, self.world_size = int(numel), int(world)

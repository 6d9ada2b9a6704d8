"""World size 1: the whole algorithm runs in one process, no launcher, nothing on the wire."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch

from .base import Backend


class LocalBackend(Backend):
    """A group of one rank on any device; collectives are copies."""

    name = "local"

    def __init__(self, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self._device = torch.device(device)

    def _channel_key(self) -> Hashable:
        return ("local",)

    def _open_transport(self) -> Any:
        return None

    @property
    def rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return 1

    @property
    def device(self) -> torch.device:
        return self._device

    def serves(self, device: torch.device) -> bool:
        return True

    def _all_gather(self, send: torch.Tensor, recv: torch.Tensor, async_op: bool) -> None:
        recv[0].copy_(send)

    def _all_to_all(self, send: torch.Tensor, recv: torch.Tensor, async_op: bool) -> None:
        recv.copy_(send)

    def _all_reduce_sum(self, tensor: torch.Tensor) -> None:
        pass

    def _barrier(self) -> None:
        pass

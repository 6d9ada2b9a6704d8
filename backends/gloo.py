"""gloo: torch.distributed on CPU tensors (TCP between hosts)."""

from __future__ import annotations

from .torch_dist import TorchDistBackend


class GlooBackend(TorchDistBackend):
    name = "gloo"
    device_type = "cpu"
    pg_backend = "gloo"

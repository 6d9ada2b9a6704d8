"""Shared transport over a torch.distributed process group (gloo and NCCL differ only in device)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from .base import Backend, Handle

# torch >= 2.11 renamed all_gather_into_tensor; keep both working.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class TorchDistBackend(Backend):
    """Collectives on a torch.distributed group (`group=None`: the default group)."""

    name = "torch"
    device_type = "cpu"
    pg_backend = "gloo"

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                f"the {self.name} backend needs torch.distributed: call "
                f"torch.distributed.init_process_group('{self.pg_backend}') first (torchrun sets the "
                "environment it reads), or pass backend='mpi' under mpirun")
        if group is not None and dist.get_rank(group) < 0:
            raise ValueError(f"this process (global rank {dist.get_rank()}) is not a member of the given group")
        used = dist.get_backend(group)
        if self.pg_backend not in str(used):
            raise RuntimeError(
                f"the {self.name} backend needs a process group with {self.pg_backend}, but this one uses "
                f"{used!r}: create one with torch.distributed.new_group(backend='{self.pg_backend}')")
        self.group = group

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def device(self) -> torch.device:
        return torch.device(self.device_type)

    def _all_gather(self, send: torch.Tensor, recv: torch.Tensor, async_op: bool) -> Handle | None:
        return _all_gather_single(recv.view(-1), send, group=self.group, async_op=async_op)

    def _all_to_all(self, send: torch.Tensor, recv: torch.Tensor, async_op: bool) -> Handle | None:
        return dist.all_to_all_single(recv.view(-1), send.view(-1), group=self.group, async_op=async_op)

    def _all_reduce_sum(self, tensor: torch.Tensor) -> None:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)

    def _barrier(self) -> None:
        dist.barrier(group=self.group)

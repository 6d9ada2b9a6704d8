"""The FSDP2 seams compcomm fills: a custom reduce-scatter, the hook after it, and (HSDP with
`intra=`) the replica's own all-gather and reduce-scatter over another transport.

FSDP2 calls `CompressedReduceScatter(output, input, group, op)` where it would call
`reduce_scatter_single`, with the flat gradients of one FSDP module laid out as n rows (row j is
rank j's shard), and calls the all-reduce hook with the reduce-scatter's output before dividing
it. Both hand the work to the module's `CompressionState` entry. `IntraAllGather` and
`IntraReduceScatter` only move and sum bytes exactly, through a compcomm backend over the shard
group (shared memory between a node's CPU ranks), where FSDP would use its process group.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

from ..backends import Backend
from ..backends.rank_order import sum_in_rank_order
from ..backends.shm import ShmBackend
from .modules import check_called_over

if TYPE_CHECKING:
    from .state import CompressionState

OPS = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.AVG: "mean"}


class _FreshBuffers:
    """FSDP2's comms allocate their buffers through the comm; these take plain tensors."""

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class CompressedReduceScatter(_FreshBuffers, ReduceScatter):
    """FSDP2's gradient reduce-scatter of one module, through compcomm (exact for the first
    `start_iter` iterations, then 1-bit with error feedback)."""

    def __init__(self, state: CompressionState, name: str) -> None:
        self.state, self.name = state, name

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: object,
        async_op: bool = False,
    ) -> None:
        self.state.reduce_scatter(self.name, output_tensor, input_tensor, group, _op_name(op))


def _op_name(op: object) -> str:
    if op not in OPS:
        raise ValueError(
            f"compcomm.fsdp reduces gradients by sum or mean, not {op}: leave FSDP's gradient divide "
            "factor at its default (set_gradient_divide_factor changes it)"
        )
    return OPS[op]


class IntraAllGather(_FreshBuffers, AllGather):
    """FSDP2's parameter all-gather inside a replica, through a compcomm backend: the bytes of
    every rank's input, in rank order (FSDP lays its input out in this rank's block of the
    output, which the backend's copy leaves as it is). Synchronous: the work is done when FSDP
    gets None back."""

    def __init__(self, be: Backend) -> None:
        self.be = be

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False
    ) -> None:
        check_called_over(group, self.be, "a parameter all-gather")
        send = input_tensor.reshape(-1).view(torch.uint8)
        self.be.all_gather(send, output_tensor.view(-1).view(torch.uint8).view(self.be.world_size, -1))


class IntraReduceScatter(_FreshBuffers, ReduceScatter):
    """FSDP2's exact gradient reduce-scatter inside a replica, through the shm backend's
    `exchange_blocks` (the blocks summed in rank order, then the mean's division), before compcomm's 1-bit
    average across replicas. A failure goes to `failed` instead of up: raised here, it would
    reach this replica's ranks alone, while the other replicas wait for them in the average;
    the average refuses it on every rank instead."""

    def __init__(self, be: ShmBackend, failed: Callable[[Exception], None]) -> None:
        self.be, self.failed = be, failed

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: object,
        async_op: bool = False,
    ) -> None:
        try:
            name = _op_name(op)
            check_called_over(group, self.be, "a reduce-scatter")
            out = output_tensor.view(-1)
            self.be.exchange_blocks(
                input_tensor.reshape(-1), out.numel(), out.dtype, lambda blocks: sum_in_rank_order(blocks, out)
            )
        except Exception as exc:
            self.failed(exc)
            return
        if name == "mean":
            output_tensor.div_(self.be.world_size)


def all_reduce_hook(state: CompressionState, name: str) -> Callable[[torch.Tensor], None]:
    """The hook FSDP2 runs on a module's reduced gradient shard: the mean across replicas."""

    def hook(reduce_output: torch.Tensor) -> None:
        state.all_reduce(name, reduce_output)

    return hook

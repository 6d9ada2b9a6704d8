"""The two FSDP2 seams compcomm fills: a custom reduce-scatter, and the hook after it.

FSDP2 calls `CompressedReduceScatter(output, input, group, op)` where it would call
`reduce_scatter_single`, with the flat gradients of one FSDP module laid out as n rows (row j is
rank j's shard), and calls the all-reduce hook with the reduce-scatter's output before dividing
it. Both hand the work to the module's `CompressionState` entry.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

if TYPE_CHECKING:
    from .state import CompressionState

OPS = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.AVG: "mean"}


class CompressedReduceScatter(ReduceScatter):
    """FSDP2's gradient reduce-scatter of one module, through compcomm (exact for the first
    `start_iter` iterations, then 1-bit with error feedback)."""

    def __init__(self, state: CompressionState, name: str) -> None:
        self.state, self.name = state, name

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: object,
        async_op: bool = False,
    ) -> None:
        if op not in OPS:
            raise ValueError(
                f"compcomm.fsdp reduces gradients by sum or mean, not {op}: leave FSDP's gradient divide "
                "factor at its default (set_gradient_divide_factor changes it)"
            )
        self.state.reduce_scatter(self.name, output_tensor, input_tensor, group, OPS[op])


def all_reduce_hook(state: CompressionState, name: str) -> Callable[[torch.Tensor], None]:
    """The hook FSDP2 runs on a module's reduced gradient shard: the mean across replicas."""

    def hook(reduce_output: torch.Tensor) -> None:
        state.all_reduce(name, reduce_output)

    return hook

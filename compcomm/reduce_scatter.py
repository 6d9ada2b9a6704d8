"""The compressed reduce-scatter: each rank gets its own shard of the sum (or mean) over ranks.

`compressed_reduce_scatter(output, tensor, error_feedback)` cuts each rank's flat `tensor` of
N = n L elements into n rows of L (row j belongs to rank j) and writes into `output` (L
elements) this rank's row of the reduction, with 1 bit per element and one fp32 scale per row on
the wire, and error feedback on the sending side:

    x'_r = x_r + e_r,   s_(r,j) = ||x'_r[row j]|| / sqrt(L),   e_r[row j] <- x'_r[row j] - s_(r,j) sign(x'_r[row j])
    output on rank j = (sum_r s_(r,j) sign(x'_r[row j])) / d     (d = n for "mean", 1 for "sum")

The schedule (`compcomm.schedules.reduce_scatter`) writes the numerics out in full; the call
starts with the same agreement as the allreduce, so a bad call on any rank raises the same error
on every rank and changes nothing. This is what FSDP2's gradient reduce-scatter becomes under
`compcomm.fsdp.compress`.
"""

from __future__ import annotations

import torch

from . import schedules
from .agreement import CallSpec
from .backends import Backend
from .backends.ordering import Pending
from .backends.registry import resolve_for_call
from .error_feedback import ErrorFeedback


def compressed_reduce_scatter(
    output: torch.Tensor,
    tensor: torch.Tensor,
    error_feedback: ErrorFeedback,
    backend: Backend | str | None = None,
    op: str = "mean",
    async_op: bool = False,
    min_compress_bytes: int | None = None,
    error_feedback_out: ErrorFeedback | None = None,
) -> torch.Tensor | Pending:
    """Reduce `tensor` (N = n L elements on every rank) over all ranks and write this rank's row
    (L elements: rank j gets elements [jL, (j+1)L) of the reduction) into `output`; returns it.

    `error_feedback` carries this rank's worker error (fp32, n rows of L rounded up to a multiple
    of 8: N elements when L is one) from call to call: one per reduced tensor. `op`,
    `async_op`, `min_compress_bytes` and `error_feedback_out` mean what they mean for
    `compressed_allreduce`. Raises TypeError, ValueError or NonFiniteError on every rank alike,
    with nothing modified, when any rank's call is bad (an input that does not split into n
    rows, an output that is not one row of it, NaN/Inf, ...).
    """
    be, refused = resolve_for_call(backend, tensor)
    spec = CallSpec.of(
        [tensor], [error_feedback], op, None if error_feedback_out is None else [error_feedback_out], min_compress_bytes
    )
    spec.outputs, spec.refused = [output], refused
    return be.ordered(lambda: _run(spec, be)[0], async_op=async_op)


def _run(spec: CallSpec, be: Backend) -> list[torch.Tensor]:
    with torch.no_grad():
        return schedules.reduce_scatter(spec, be)

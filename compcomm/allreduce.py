"""The compressed allreduce: average (or sum) a tensor over all ranks with 1 bit per element.

`compressed_allreduce(tensor, error_feedback)` runs, for world size n, rank r and N elements
padded to M = ceil(N / 8n) * 8n (chunk C = M / n, served by rank j):

    worker r:   x' = pad(x) + e_w,   s_r = ||x'[:N]|| / sqrt(N),   e_w <- x' - s_r sign(x')
    server j:   y = (1/n) sum_r s_r sign(x'_r)[chunk j] + e_s,   t_j = ||y[:k_j]|| / sqrt(k_j),
                e_s <- y - t_j sign(y)
    output:     chunk j of the result is t_j sign(y_j), bitwise the same on every rank

with sign(v) = +1 for v >= 0, the errors e_w (worker) and e_s (server) carried by the tensor's
`ErrorFeedback` from call to call, and k_j the real elements of chunk j. The schedule that moves
the bytes is chosen by the backend: `compcomm.schedules.flat` (one group: the phases, the wire
format and the bounds are written there) or `compcomm.schedules.hierarchical` (exact inside a
node, 1-bit between nodes). Every call starts with the agreement of `compcomm.agreement`: a bad
call on any rank raises the same error on every rank and changes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, overload

import torch

from . import schedules
from .agreement import CallSpec
from .backends import Backend
from .backends.ordering import Pending
from .backends.registry import resolve_for_call
from .error_feedback import ErrorFeedback


@overload
def compressed_allreduce(
    tensor: torch.Tensor,
    error_feedback: ErrorFeedback,
    backend: Backend | str | None = ...,
    op: str = ...,
    async_op: Literal[False] = ...,
    min_compress_bytes: int | None = ...,
    error_feedback_out: ErrorFeedback | None = ...,
) -> torch.Tensor: ...


@overload
def compressed_allreduce(
    tensor: torch.Tensor,
    error_feedback: ErrorFeedback,
    backend: Backend | str | None = ...,
    op: str = ...,
    async_op: Literal[True] = ...,
    min_compress_bytes: int | None = ...,
    error_feedback_out: ErrorFeedback | None = ...,
) -> Pending: ...


def compressed_allreduce(
    tensor: torch.Tensor,
    error_feedback: ErrorFeedback,
    backend: Backend | str | None = None,
    op: str = "mean",
    async_op: bool = False,
    min_compress_bytes: int | None = None,
    error_feedback_out: ErrorFeedback | None = None,
) -> torch.Tensor | Pending:
    """Average (op="mean") or sum (op="sum") `tensor` over all ranks in place, with 1-bit
    compression and error feedback carried in `error_feedback`; returns `tensor`.

    The result is bitwise identical on every rank. Raises TypeError, ValueError or
    NonFiniteError on every rank alike, with nothing modified, when any rank's call is bad (a
    `backend` that cannot be built keeps its own type, e.g. ImportError).
    With async_op=True it returns at once a handle (`wait()`, `is_completed()`, `get_future()`)
    whose `wait()` returns the tensor or raises; leave the tensor alone until then. compcomm's
    calls on a group run in the order they were submitted, on a private duplicate of the group,
    so the caller's own collectives may run meanwhile.

    `min_compress_bytes` (default None: always compress): a tensor of fewer bytes is reduced
    exactly (fp32 sums in rank order; over a hierarchical backend the exact mean of the node
    means; the same checks, `error_feedback` left as it is), for
    small tensors where the 1-bit code saves no time; every rank must pass the same value.

    `error_feedback_out` (default None: `error_feedback` itself) receives the error state after
    the call, and `error_feedback` is then left as it was: for a caller that keeps the old state
    until it knows that a larger step succeeded (an optimizer whose later bucket may fail), at
    the cost of no copy (the errors are written once, into its buffers, which it reuses).
    Whatever `error_feedback_out` held before is replaced, its tag too: a compressed call's scan
    writes the new worker state into its buffer before the ranks have agreed, so a call rejected
    after that leaves it holding no errors (as after `reset()`), and `error_feedback` as it was.
    """
    be, refused = resolve_for_call(backend, tensor)
    spec = CallSpec.of(
        [tensor], [error_feedback], op, None if error_feedback_out is None else [error_feedback_out], min_compress_bytes
    )
    spec.refused = refused
    return be.ordered(lambda: _run(spec, be)[0], async_op=async_op)


def compressed_allreduce_coalesced(
    tensors: Sequence[torch.Tensor],
    error_feedbacks: Sequence[ErrorFeedback],
    backend: Backend | str | None = None,
    op: str = "mean",
    async_op: bool = False,
    min_compress_bytes: int | None = None,
    error_feedbacks_out: Sequence[ErrorFeedback] | None = None,
) -> list[torch.Tensor] | Pending:
    """`compressed_allreduce` of several tensors (one ErrorFeedback each) as one call: one
    phase-0 agreement for all of them, so either every tensor is reduced on every rank or none
    is and nothing changes (e.g. a NaN in the last bucket leaves the first bucket's error state
    untouched). Returns the list of tensors, or a handle with async_op=True.
    `error_feedbacks_out`: one per tensor, as `compressed_allreduce`'s `error_feedback_out`."""
    return allreduce_call(
        CallSpec.of(tensors, error_feedbacks, op, error_feedbacks_out, min_compress_bytes), backend, async_op
    )


def allreduce_call(
    spec: CallSpec, backend: Backend | str | None = None, async_op: bool = False
) -> list[torch.Tensor] | Pending:
    """`compressed_allreduce_coalesced` of a call already put together, for callers inside the
    library that set what its keywords do not (`CallSpec.limits`)."""
    be, spec.refused = resolve_for_call(backend, spec.tensors[0] if spec.tensors else None)  # agreed in phase 0
    return be.ordered(lambda: _run(spec, be), async_op=async_op)


def _run(spec: CallSpec, be: Backend) -> list[torch.Tensor]:
    with torch.no_grad():
        return schedules.allreduce(spec, be)

"""The error-feedback 1-bit reduce-scatter: each rank ends with the reduced shard it owns.

Rank r views its flat input x_r of N = n L elements as n rows of L (row j belongs to rank j),
each row padded to L8 = ceil(L / 8) * 8 in the error and sign buffers:

    worker r:   x'_r = x_r + e_r                     (e_r: (n, L8) fp32, its "input-sized" error)
                s_(r,j) = ||x'_r[row j][:L]|| / sqrt(L)              one scale per row
                e_r[row j] <- x'_r[row j] - s_(r,j) sign(x'_r[row j])   (0 on each row's padding)
    phase 0:    the agreement (`compcomm.agreement`), with each rank's largest row scale as the
                bound of what it adds, and the first bytes of every row's message folded in
    phase 1:    one all-to-all: rank j receives (s_(r,j), packed sign(x'_r[row j])) from every r
    owner j:    out = (sum_r s_(r,j) sign(x'_r[row j])) / d    summed in rank order in fp32,
                d = n for op="mean", 1 for "sum"; written in the output's dtype

sign(v) is +1 for v >= 0 (so for -0.0 too); bits are packed MSB-first, 1 meaning +1. There is no
server error: each row has one owner, which decodes it exactly. Summed over calls, the outputs
plus the owners' shares of the worker errors ((1/d) sum_r e_r[row j]) equal the sums of the true
reductions. Per rank on the wire: (n-1)/n x (N/8 + 4n) bytes and a 16-byte header to each peer,
against (n-1)/n x 4N for fp32.

One scale per row: the scale is what the row's owner needs, it costs 4 bytes per row and the
existing fused kernels take a row per launch; finer blocks would need kernels of their own.

A tensor reduced exactly (warm-up, or below `min_compress_bytes`) sends its rows as fp32 and
the owner sums them in rank order (then divides by d); its error feedback is neither used nor
changed.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .. import codec
from ..agreement import Agreement, CallSpec, Measured, agree_on_call, exchange_rows
from ..backends import Backend
from ..error_feedback import REDUCE_SCATTER, ErrorFeedback, Served
from ..errors import largest_magnitude
from . import flat

ROW_SCALE_BYTES = 4
"""Each row's message: its scale s_(r,j) as fp32 bytes, then its packed signs."""


def reduce_scatter(spec: CallSpec, be: Backend) -> list[torch.Tensor]:
    """Run `spec` over `be`: phase 0, then the all-to-all and every owner's decode. Returns the
    outputs (`spec.outputs`)."""
    for call in prepare(spec, be):
        call.commit()
    assert spec.outputs is not None
    return spec.outputs


def prepare(spec: CallSpec, be: Backend) -> list[ShardCall]:
    """This rank's checks and row scans, then phase 0 over `be`: the calls ready to `commit()`,
    or the agreed error raised on every rank with nothing modified."""
    n = be.world_size
    prepared: list[tuple[torch.Tensor, torch.Tensor, list[float]]] = []

    def measure(i: int) -> Measured:
        tensor, ef = spec.tensors[i], spec.error_feedbacks[i]
        _check_shapes(tensor, spec.outputs[i] if spec.outputs is not None and i < len(spec.outputs) else None, n)
        flat_input = tensor.detach().reshape(-1)
        if spec.reduced_exactly(i):
            rows = flat_input.to(torch.float32).view(n, -1).view(torch.uint8)
            prepared.append((flat_input, rows, []))
            return Measured(largest_magnitude(flat_input), 0.0, rows)
        rows, scales = _row_scan(flat_input, ef, n)
        prepared.append((flat_input, rows, scales))
        bound = max(scales) if all(math.isfinite(s) for s in scales) else math.inf
        return Measured(bound, 0.0, rows)

    agreement = agree_on_call(
        spec,
        be,
        "reduce_scatter",
        be.sequence_number(),
        measure,
        lambda numel: _rows(numel, n, spec.owner_over(be)),
    )
    return [
        ShardCall(spec, i, be, agreement, flat_input, rows, scales, spec.reduced_exactly(i))
        for i, (flat_input, rows, scales) in enumerate(prepared)
    ]


def _rows(numel: int, n: int, rank: int) -> Served:
    """What the ErrorFeedback of a `numel`-element input serves on `rank`; ValueError when the
    input does not split into n rows."""
    if numel % n:
        raise ValueError(
            f"a reduce-scatter over {n} ranks needs an input whose numel is a multiple of {n}, got {numel}"
        )
    return numel, n, REDUCE_SCATTER, rank


def _check_shapes(tensor: torch.Tensor, output: torch.Tensor | None, n: int) -> None:
    """ValueError/TypeError for an output that is not one row of the input."""
    if not isinstance(output, torch.Tensor):
        raise TypeError(f"the output of a reduce-scatter must be a torch.Tensor, got {type(output).__name__}")
    if output.numel() != tensor.numel() // n or output.dtype != tensor.dtype or output.device != tensor.device:
        raise ValueError(
            f"the output must be one row of the input: {tensor.numel() // n} elements of {tensor.dtype} on "
            f"{tensor.device}, got {output.numel()} of {output.dtype} on {output.device}"
        )
    if not output.is_contiguous():
        raise ValueError("the output of a reduce-scatter must be contiguous")


def _row_width(length: int) -> int:
    """Bytes of one row's message: its scale and the packed signs of its padded length."""
    return ROW_SCALE_BYTES + -(-length // 8)


def _row_scan(flat_input: torch.Tensor, ef: ErrorFeedback, n: int) -> tuple[torch.Tensor, list[float]]:
    """The (n, W) row messages (scale, packed signs of x' = x + e) and the row scales.
    Nothing is modified."""
    length = flat_input.numel() // n
    padded = -(-length // 8) * 8
    rows = torch.empty(n, _row_width(length), dtype=torch.uint8, device=flat_input.device)
    worker = ef.worker_error.to(flat_input.device).view(n, padded) if ef.worker_error is not None else None
    coder = codec.codec_for(flat_input.device)
    scales = []
    for j in range(n):
        x = flat_input[j * length : (j + 1) * length]
        sum_sq = coder.worker_scan(x, None if worker is None else worker[j], rows[j, ROW_SCALE_BYTES:])
        scales.append(codec.rms_scale(sum_sq, length))
    rows[:, :ROW_SCALE_BYTES].copy_(torch.tensor(scales, dtype=torch.float32).view(torch.uint8).view(n, -1))
    return rows, scales


@dataclass
class ShardCall:
    """One tensor of a reduce-scatter accepted by phase 0 on every rank."""

    spec: CallSpec
    index: int
    be: Backend
    agreement: Agreement
    flat_input: torch.Tensor  # the input's flat view, or a contiguous copy
    rows: torch.Tensor  # (n, W): row j's message to rank j (scale and signs, or fp32 if exact)
    scales: list[float]  # this rank's s_(r,j), per row j (empty if exact)
    exact: bool

    def commit(self) -> torch.Tensor:
        """The all-to-all and this rank's decode; writes the errors after the call; returns
        this rank's output shard."""
        with torch.no_grad():
            return self.be.ordered(self._commit)

    def _commit(self) -> torch.Tensor:
        assert self.spec.outputs is not None
        output = self.spec.outputs[self.index]
        n = self.be.world_size
        divisor = n if self.spec.op == "mean" else 1
        if self.exact:
            total = flat.exact_sum(self._exchange(lambda: None), divisor)
            output.copy_(total.view(output.shape))
            into, ef = self.spec.into(self.index), self.spec.error_feedbacks[self.index]
            if into is not ef:
                into.copy_(ef)  # the errors after the call are those before it
            return output
        received = self._exchange(self._update_errors)
        length = self.flat_input.numel() // n
        coder = codec.codec_for(output.device)
        scales = received[:, :ROW_SCALE_BYTES].reshape(-1).clone().view(torch.float32)
        padded = -(-length // 8) * 8
        # The sum accumulates in fp32 from zero; an fp32 output of whole bytes of signs takes it
        # directly, which spares a buffer of 1/n of the input (the call's largest).
        direct = output.dtype == torch.float32 and length == padded
        total = output.view(-1).zero_() if direct else torch.zeros(padded, dtype=torch.float32, device=output.device)
        scratch = torch.empty(padded // 8, dtype=torch.uint8, device=output.device)
        coder.server_scan_(received[:, ROW_SCALE_BYTES:], scales, divisor, total, length, scratch)
        if not direct:
            output.copy_(total[:length].view(output.shape))
        return output

    def _update_errors(self) -> None:
        """e_r[row j] <- x'_r[row j] - s_(r,j) sign(x'_r[row j]), row by row, into the call's
        error feedback (`spec.into`)."""
        n, numel, device = self.be.world_size, self.flat_input.numel(), self.flat_input.device
        length = numel // n
        into = self.spec.into(self.index)
        worker, _, worker_out = into.follow(self.spec.error_feedbacks[self.index], numel, n, device, REDUCE_SCATTER)
        into.rank = self.spec.owner_over(self.be)
        rows_in, rows_out = worker.view(n, -1), worker_out.view(n, -1)
        coder = codec.codec_for(device)
        for j in range(n):
            x = self.flat_input[j * length : (j + 1) * length]
            coder.error_update_(rows_in[j], self.scales[j], length, x, None if worker_out is worker else rows_out[j])

    def _exchange(self, meanwhile: Callable[[], None]) -> torch.Tensor:
        """(n, W): row r is what rank r sent this one, while `meanwhile()` runs."""
        return exchange_rows(self.be, self.rows, self.agreement.early if self.index == 0 else None, meanwhile)

"""The error-compensated 1-bit allreduce, written once for every backend.

For world size n and N elements padded to M = ceil(N / 8n) * 8n, chunk C = M / n:

    worker r:   x' = pad(x) + e_w           s_r = ||x'[:N]|| / sqrt(N)
                e_w <- x' - s_r sign(x')     (0 on padding)
    phase 0:    all-to-all of one slot per server: slot j holds this rank's `HEADER` (so every
                rank validates every rank's call) and the first bytes of its packed signs for
                server j, as many as the slots' agreed room holds (see `FOLD_BYTES`)
    phase 1:    all-to-all of the rest of the packed signs: rank j gets chunk j of each sign(x'_r)
                (no phase 1 when phase 0 carried them all: repeated small calls)
    server j:   y = (1/n) sum_r s_r sign(x'_r)[chunk j] + e_s       t_j = ||y[:k]|| / sqrt(k)
                e_s <- y - t_j sign(y)       (0 beyond the k real elements)
    phase 2:    all-gather of (t_j, packed sign(y)) in one collective
    output:     chunk j of the result is t_j sign(y_j) on every rank, bit for bit.

sign(v) is +1 for v >= 0 (so for -0.0 too); bits are packed MSB-first, 1 meaning +1.

Phase 0 decides, before anything is modified, whether the call goes ahead on every rank. It
rejects, with the same error on every rank: a rank's own bad arguments (TypeError/ValueError
raised locally, carried as a code), ranks disagreeing on the number of tensors, op, dtype, numel
or ErrorFeedback tag, ranks out of step (the call's sequence number on the group differs), NaN/Inf
in any rank's input or error state, and sums that could overflow: with B = sum_r s_r, the server's
fp32 partial sums stay below B and |y| below B/n (or B for "sum") + max|e_s|, so the call is refused
(NonFiniteError) when either bound reaches the top of fp32 or of the output dtype. A finite input
therefore never yields a non-finite output or error state. Phase 0's slots have the same size on
every rank whatever the arguments, so ranks passing different sizes are told so instead of hanging.

With `min_compress_bytes`, a tensor of fewer bytes is reduced exactly instead, through the same
phases and checks: phase 0/1 carry fp32 chunk j of x to server j, which sums them in rank order
(then divides by n for "mean"), and phase 2 all-gathers the sums, so the result is again bitwise
the same on every rank and backend. Its error feedback is neither used nor changed.
"""

from __future__ import annotations

import math
import numbers
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple, overload

import numpy as np
import torch

from . import codec
from .backends import Backend, resolve
from .error_feedback import ErrorFeedback
from .errors import NonFiniteError, largest_magnitude
from .layout import chunk_size, real_count
from .ordering import Pending

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
OPS = ("mean", "sum")

CALL = np.dtype(
    [
        ("count", "<i8"),  # tensors in the call (coalesced calls carry several)
        ("seq", "<i8"),  # the call's ticket on the group: equal on every rank unless out of step
        ("numel", "<i8"),
        ("tag", "<u4"),  # ErrorFeedback.fingerprint
        ("op", "u1"),  # index in OPS
        ("dtype", "u1"),  # index in FLOAT_DTYPES
        ("exact", "u1"),  # 1 when reduced exactly (below min_compress_bytes)
        ("reserved", "V1"),
    ]
)
"""What every rank must agree on, per tensor. Only its digest travels, unless the digests differ."""

HEADER = np.dtype(
    [
        ("scale", "<f4"),  # s_r, the worker's RMS scale (inf/NaN when x' is not finite)
        ("server_max", "<f4"),  # max |e_s| of this rank's server error (bounds the server sums)
        ("digest", "<u4"),  # crc32 of the tensor's CALL record
        ("code", "<i4"),  # 0, or 1 + index in ERRORS of the error this rank's own checks raised
    ]
)
"""Phase 0's per-tensor wire format (16 bytes per tensor and rank)."""

FOLD_BYTES = 128 * 1024
"""The most phase-1 bytes per rank that phase 0's all-to-all carries. Its slots have the same size
on every rank whatever the arguments: a HEADER plus the room of the group's previous accepted call
(its first tensor's row width, at most FOLD_BYTES / n; none for a group's first call), which every
rank knows alike. So a repeated call whose rows fit costs two collective latencies instead of three
(1-bit: up to 4 MiB of fp32 at n = 4), a larger call sends the rest in phase 1, and no call carries
more padding than its predecessor's rows. FOLD_BYTES is about one latency's worth of bytes at
10 Gbit/s (~100 us)."""

SERVER_SCALE_BYTES = 4
"""Phase 2's message of server j: t_j as fp32 bytes, then the packed signs of sign(y_j)."""

ERRORS: tuple[type[Exception], ...] = (TypeError, ValueError, NonFiniteError, RuntimeError)
"""Errors carried by index (`error_code`): a rank's own checks in HEADER.code, and a composite
schedule's verdicts between its groups (others travel as RuntimeError)."""

_MESSAGE_BYTES = 1024
_HEADROOM = 1.0 - 2.0**-10  # fp32 rounding of the partial sums stays well inside this
_LARGEST = {
    torch.float32: float(torch.finfo(torch.float32).max),
    torch.float16: float(torch.finfo(torch.float16).max),
    torch.bfloat16: float(torch.finfo(torch.bfloat16).max),
}


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
    NonFiniteError on every rank alike, with nothing modified, when any rank's call is bad.
    With async_op=True it returns at once a handle (`wait()`, `is_completed()`, `get_future()`)
    whose `wait()` returns the tensor or raises; leave the tensor alone until then. compcomm's
    calls on a group run in the order they were submitted, on a private duplicate of the group,
    so the caller's own collectives may run meanwhile.

    `min_compress_bytes` (default None: always compress): a tensor of fewer bytes is reduced
    exactly (fp32 sums in rank order, the same checks, `error_feedback` left as it is), for
    small tensors where the 1-bit code saves no time; every rank must pass the same value.

    `error_feedback_out` (default None: `error_feedback` itself) receives the error state after
    the call, and `error_feedback` is then left as it was: for a caller that keeps the old state
    until it knows that a larger step succeeded (an optimizer whose later bucket may fail), at
    the cost of no copy (the errors are written once, into its buffers, which it reuses).
    Whatever `error_feedback_out` held before is replaced, its tag too.
    """
    be = resolve(backend, tensor)
    outs = None if error_feedback_out is None else [error_feedback_out]
    return be.ordered(lambda: _run([tensor], [error_feedback], be, op, min_compress_bytes, outs)[0], async_op=async_op)


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
    tensors, efs = _as_list(tensors, "tensors"), _as_list(error_feedbacks, "error_feedbacks")
    outs = _as_outs(error_feedbacks_out)
    be = resolve(backend, tensors[0] if tensors else None)  # a bad pairing is an agreed error, in phase 0
    return be.ordered(lambda: _run(tensors, efs, be, op, min_compress_bytes, outs), async_op=async_op)


def prepare(
    tensor: torch.Tensor,
    error_feedback: ErrorFeedback,
    backend: Backend,
    op: str = "mean",
    dtype: torch.dtype | None = None,
    exact: bool = False,
    error_feedback_out: ErrorFeedback | None = None,
) -> PreparedCall:
    """The first half of a call: local checks and the phase-0 agreement over `backend`.

    Raises the agreed error on every rank of `backend`, modifying nothing, or returns the call
    ready to `commit()`. For composite schedules (a hierarchical backend) that must agree across
    another group before committing; run both halves inside that schedule's ordered call.
    `dtype` is the dtype the result ends in when not the tensor's (a composite reducing an fp32
    part of a half-precision tensor), for the overflow verdict; `exact` reduces it uncompressed;
    `error_feedback_out` as in `compressed_allreduce`.
    """
    return prepare_coalesced(
        [tensor],
        [error_feedback],
        backend,
        op,
        None if dtype is None else [dtype],
        [exact],
        None if error_feedback_out is None else [error_feedback_out],
    )[0]


def prepare_coalesced(
    tensors: Sequence[torch.Tensor],
    error_feedbacks: Sequence[ErrorFeedback],
    backend: Backend,
    op: str = "mean",
    dtypes: Sequence[torch.dtype] | None = None,
    exact: Sequence[bool] | None = None,
    error_feedbacks_out: Sequence[ErrorFeedback] | None = None,
) -> list[PreparedCall]:
    """`prepare` of several tensors with one phase-0 agreement (as `compressed_allreduce_coalesced`)."""
    tensors, efs = _as_list(tensors, "tensors"), _as_list(error_feedbacks, "error_feedbacks")
    outs = _as_outs(error_feedbacks_out)
    flags = [False] * len(tensors) if exact is None else [bool(e) for e in exact]
    return backend.ordered(lambda: _prepare(tensors, efs, backend, op, lambda i, t: flags[i], dtypes, outs))


def agree(
    tensors: Sequence[torch.Tensor],
    error_feedbacks: Sequence[ErrorFeedback],
    backend: Backend,
    op: str,
    part: Callable[[int], tuple[int, int]],
    min_compress_bytes: int | None = None,
    error_feedbacks_out: Sequence[ErrorFeedback] | None = None,
) -> list[bool]:
    """Phase 0 of a composite call, without the worker scan: this rank's checks of its
    arguments, each ErrorFeedback serving the (numel, world_size) `part(tensor.numel())` of the
    work, then agreement over `backend` on count, sequence, numel, op, dtype, tag and which
    tensors go uncompressed (returned, one flag per tensor). Raises the agreed error on every
    rank of `backend`, modifying nothing. Run it inside the composite's ordered call."""
    flags: list[bool] = []

    def check(i: int, tensor: torch.Tensor, ef: ErrorFeedback, headers: np.ndarray) -> Scanned:
        check_arguments(tensor, ef, backend, op, part)
        flags.append(below(tensor, min_compress_bytes))
        return Scanned(tensor.dtype, flags[-1])

    outs = _as_outs(error_feedbacks_out)
    _phase0(
        _as_list(tensors, "tensors"),
        _as_list(error_feedbacks, "error_feedbacks"),
        backend,
        op,
        check,
        fold=False,
        outs=outs,
    )
    return flags


def below(tensor: torch.Tensor, min_compress_bytes: int | None) -> bool:
    """Whether `tensor` goes uncompressed: fewer bytes than `min_compress_bytes` (None: never)."""
    if min_compress_bytes is None:
        return False
    if (
        isinstance(min_compress_bytes, bool)
        or not isinstance(min_compress_bytes, numbers.Integral)
        or min_compress_bytes < 0
    ):
        raise ValueError(f"min_compress_bytes must be None or a number of bytes >= 0, got {min_compress_bytes!r}")
    return tensor.numel() * tensor.element_size() < min_compress_bytes


def _run(
    tensors: list[torch.Tensor],
    efs: list[ErrorFeedback],
    be: Backend,
    op: str,
    min_compress_bytes: int | None,
    outs: list[ErrorFeedback] | None = None,
) -> list[torch.Tensor]:
    schedule = getattr(be, "compressed_schedule", None)  # a composite backend's own schedule
    with torch.no_grad():
        if schedule is not None:
            return schedule(tensors, efs, op, min_compress_bytes, outs)
        for call in _prepare(tensors, efs, be, op, lambda i, t: below(t, min_compress_bytes), outs=outs):
            call.commit()
    return tensors


class Scanned(NamedTuple):
    """What phase 0 needs of one tensor after this rank's checks."""

    dtype: torch.dtype  # the dtype the result ends in (for the overflow verdict)
    exact: bool  # reduced uncompressed
    rows: torch.Tensor | None = None  # (n, W) bytes of phase 1, row j for server j


@dataclass
class PreparedCall:
    """One tensor's call accepted by phase 0 on every rank: all that phases 1 and 2 need."""

    tensor: torch.Tensor  # the caller's tensor (detached), written at the end
    flat: torch.Tensor  # its flat fp view or contiguous copy
    ef: ErrorFeedback  # the errors the call starts from
    into: ErrorFeedback  # where the errors after the call go: `ef` itself, or one that takes them
    be: Backend
    op: str
    rows: torch.Tensor  # (n, W) bytes of phase 1, row j for server j: packed signs, or fp32 if exact
    early: torch.Tensor | None  # (n, e) the first e bytes of what each rank sent this one, from phase 0
    scales: np.ndarray  # every rank's s_r (fp32); max |x_r| if exact
    scale: float  # this rank's s_r
    exact: bool  # reduced uncompressed (below min_compress_bytes)
    result: torch.Tensor | None = None  # after commit: phase 2's bytes, see `decode_result`

    def commit(self) -> torch.Tensor:
        """Phases 1 and 2 and the decode; updates the error feedback; returns the tensor."""
        with torch.no_grad():
            return self.be.ordered(self._commit)

    def _commit(self) -> torch.Tensor:
        """Each error update runs while the collective that does not depend on it is in flight."""
        if self.exact:
            self.result = self._gather(self._exact_sum(self._phase1(lambda: None)), lambda: None)
            if self.into is not self.ef:
                self.into.copy_(self.ef)  # the errors after the call are those before it
        else:
            self.result = self._one_bit()
        decode_result(self.result, self.flat, self.exact)
        if self.flat.data_ptr() != self.tensor.data_ptr() or not self.tensor.is_contiguous():
            self.tensor.copy_(self.flat.view(self.tensor.shape))
        return self.tensor

    def _one_bit(self) -> torch.Tensor:
        be, flat, numel = self.be, self.flat, self.flat.numel()
        n, device = be.world_size, flat.device
        worker, server, worker_out = self.into.follow(self.ef, numel, n, device)
        coder = codec.codec_for(device)
        received = self._phase1(lambda: coder.error_update_(worker, self.scale, numel, flat, worker_out))
        served = real_count(be.rank, numel, n)
        mine = torch.empty(SERVER_SCALE_BYTES + received.shape[1], dtype=torch.uint8, device=device)
        divisor = n if self.op == "mean" else 1
        sum_sq = coder.server_scan_(
            received, torch.from_numpy(self.scales).to(device), divisor, server, served, mine[SERVER_SCALE_BYTES:]
        )
        server_scale = codec.rms_scale(sum_sq, served)
        mine[:SERVER_SCALE_BYTES].copy_(torch.tensor([server_scale], dtype=torch.float32).view(torch.uint8))

        def server_update() -> None:
            coder.error_update_(server, server_scale, served)
            self.into.record_server_max()

        return self._gather(mine, server_update)

    def _phase1(self, meanwhile: Callable[[], None]) -> torch.Tensor:
        """(n, W): row r is what rank r sent this one; the part phase 0 did not carry goes now,
        while `meanwhile()` runs."""
        done = 0 if self.early is None else self.early.shape[1]
        if done == self.rows.shape[1]:
            meanwhile()
            received = self.early.contiguous() if self.early is not None else torch.empty_like(self.rows)
        else:
            rest = self.rows if done == 0 else self.rows[:, done:].contiguous()
            got = torch.empty_like(rest)
            in_flight = self.be.all_to_all(rest, got, async_op=True)
            meanwhile()
            in_flight.wait()
            received = got if self.early is None else torch.cat([self.early, got], dim=1)
        self.rows = received  # drop what was sent
        return received

    def _exact_sum(self, received: torch.Tensor) -> torch.Tensor:
        """This server's chunk of the exact reduction: fp32 rows summed in rank order (/ n for mean)."""
        parts = _as_fp32(received)
        total = parts[0].clone()
        for row in parts[1:]:
            total.add_(row)
        if self.op == "mean":
            total.div_(self.be.world_size)
        return total.view(torch.uint8)

    def _gather(self, mine: torch.Tensor, meanwhile: Callable[[], None]) -> torch.Tensor:
        """Phase 2: every server's message, (n, len(mine)), while `meanwhile()` runs."""
        everyone = torch.empty(self.be.world_size, mine.numel(), dtype=torch.uint8, device=mine.device)
        in_flight = self.be.all_gather(mine, everyone, async_op=True)
        meanwhile()
        in_flight.wait()
        return everyone


def decode_result(everyone: torch.Tensor, out: torch.Tensor, exact: bool = False) -> None:
    """out (the N-element flat output, any float dtype) <- the call's result, from phase 2's bytes:
    row j holds server j's t_j (fp32) and the packed signs of its chunk, or if `exact` its fp32 sums."""
    n, numel = everyone.shape[0], out.numel()
    if exact:
        out.copy_(_as_fp32(everyone).view(-1)[:numel])
        return
    c = chunk_size(numel, n)
    coder = codec.codec_for(out.device)
    server_scales = everyone[:, :SERVER_SCALE_BYTES].reshape(-1).view(torch.float32).tolist()
    for j in range(n):
        start, k = j * c, real_count(j, numel, n)
        if k:
            coder.decode(everyone[j, SERVER_SCALE_BYTES:], server_scales[j], out[start : start + k])


def _as_fp32(rows: torch.Tensor) -> torch.Tensor:
    """(n, 4C) contiguous bytes as (n, C) fp32, also when C = 0 (an empty part)."""
    return rows.reshape(-1).view(torch.float32).view(rows.shape[0], rows.shape[1] // 4)


def _prepare(
    tensors: list[torch.Tensor],
    efs: list[ErrorFeedback],
    be: Backend,
    op: str,
    exact: Callable[[int, torch.Tensor], bool],
    dtypes: Sequence[torch.dtype] | None = None,
    outs: list[ErrorFeedback] | None = None,
) -> list[PreparedCall]:
    """This rank's checks and worker scans, then phase 0; raises the agreed error everywhere."""
    scanned: list[tuple[torch.Tensor, torch.Tensor, float, bool]] = []

    def scan(i: int, tensor: torch.Tensor, ef: ErrorFeedback, headers: np.ndarray) -> Scanned:
        check_arguments(tensor, ef, be, op)
        uncompressed = exact(i, tensor)
        flat, rows, scale = (_exact_rows if uncompressed else _worker_scan)(tensor, ef, be)
        scanned.append((flat, rows, scale, uncompressed))
        headers["scale"][i] = scale
        headers["server_max"][i] = 0.0 if uncompressed else ef.server_error_max()
        return Scanned(tensor.dtype if dtypes is None else dtypes[i], uncompressed, rows)

    everyone, early = _phase0(tensors, efs, be, op, scan, fold=True, outs=outs)
    scales = everyone["scale"].astype(np.float32)
    return [
        PreparedCall(
            tensor.detach(),
            flat,
            ef,
            into,
            be,
            op,
            rows,
            early if i == 0 else None,
            scales[:, i].copy(),
            scale,
            uncompressed,
        )
        for i, (tensor, ef, into, (flat, rows, scale, uncompressed)) in enumerate(
            zip(tensors, efs, outs or efs, scanned)
        )
    ]


def _phase0(
    tensors: list[torch.Tensor],
    efs: list[ErrorFeedback],
    be: Backend,
    op: str,
    local: Callable[[int, torch.Tensor, ErrorFeedback, np.ndarray], Scanned],
    fold: bool,
    outs: list[ErrorFeedback] | None = None,
) -> tuple[np.ndarray, torch.Tensor | None]:
    """Phase 0: `local(i, tensor, ef, headers)` runs this rank's checks of tensor i (filling what
    it measured into headers[i]), then every rank's headers are gathered and judged alike, with
    the first tensor's rows folded in (`fold`). Returns them, (n, count), and what the other ranks
    sent this one of the first tensor's rows, or raises the agreed error everywhere."""
    count = len(tensors)
    calls = np.zeros(max(count, 1), dtype=CALL)  # one record at least: phase 0 always sends one
    calls["count"], calls["seq"] = count, be.sequence_number()
    headers = np.zeros(max(count, 1), dtype=HEADER)
    first_rows: torch.Tensor | None = None
    failure: Exception | None = None
    try:
        _check_pairs(tensors, efs, outs)
        for i, (tensor, ef) in enumerate(zip(tensors, efs)):
            scanned = local(i, tensor, ef, headers)
            _describe_call(calls, i, tensor, ef, op, scanned)
            if i == 0:
                first_rows = scanned.rows
    except Exception as exc:  # reported to every rank in phase 0, then raised everywhere
        failure, first_rows = exc, None
        headers["code"] = error_code(exc)
    headers["digest"] = [zlib.crc32(record.tobytes()) for record in calls]
    everyone, early = _exchange(headers, be, first_rows, fold)
    _raise_if_rejected(everyone, calls, failure, be)
    if fold and first_rows is not None:  # accepted: every rank has the same width
        be.channel.agreed["fold_room"] = min(FOLD_BYTES // be.world_size, first_rows.shape[1])
    return everyone, early


def _describe_call(
    calls: np.ndarray, i: int, tensor: torch.Tensor, ef: ErrorFeedback, op: str, scanned: Scanned
) -> None:
    for field, value in (
        ("numel", tensor.numel()),
        ("tag", ef.fingerprint),
        ("op", OPS.index(op)),
        ("dtype", FLOAT_DTYPES.index(scanned.dtype)),
        ("exact", scanned.exact),
    ):
        calls[field][i] = value


def error_code(exc: Exception) -> int:
    """The code of an error that travels: 1 + its index in ERRORS (RuntimeError for the rest)."""
    return 1 + next((i for i, cls in enumerate(ERRORS) if type(exc) is cls), len(ERRORS) - 1)


def _exchange(
    headers: np.ndarray, be: Backend, rows: torch.Tensor | None, fold: bool
) -> tuple[np.ndarray, torch.Tensor | None]:
    """Exchange the headers: (n, count) records, and the first tensor's early rows. The first
    record goes alone (in the folded all-to-all, or an all-gather of its own), so that ranks
    disagreeing on the count (part of the digest) are caught before sizes differ."""
    first, early = _folded(headers[:1], rows, be) if fold else (_all_gather_records(headers[:1], be), None)
    if len(headers) == 1 or (first["digest"] != first["digest"][:1]).any() or first["code"].any():
        return first, early
    return np.concatenate([first, _all_gather_records(headers[1:], be)], axis=1), early


def _folded(record: np.ndarray, rows: torch.Tensor | None, be: Backend) -> tuple[np.ndarray, torch.Tensor | None]:
    """Phase 0's all-to-all: slot j carries `record` and the first bytes of rows[j], in the
    room every rank agreed on (see FOLD_BYTES), so no argument can make sizes differ."""
    n, head = be.world_size, HEADER.itemsize
    room = be.channel.agreed.get("fold_room", 0)
    send = torch.zeros(n, head + room, dtype=torch.uint8, device=be.device)
    send[:, :head] = torch.from_numpy(record.view(np.uint8).copy()).to(be.device)
    carried = 0 if rows is None else min(room, rows.shape[1])
    if carried:
        send[:, head : head + carried].copy_(rows[:, :carried])  # type: ignore[index]
    recv = torch.empty_like(send)
    be.all_to_all(send, recv)
    records = recv[:, :head].cpu().numpy().view(HEADER).reshape(n, 1)
    return records, recv[:, head : head + carried] if carried else None


def _all_gather_records(records: np.ndarray, be: Backend) -> np.ndarray:
    send = torch.from_numpy(records.view(np.uint8).copy()).to(be.device)
    recv = torch.empty(be.world_size, send.numel(), dtype=torch.uint8, device=be.device)
    be.all_gather(send, recv)
    return recv.cpu().numpy().view(records.dtype).reshape(be.world_size, len(records))


def _worker_scan(tensor: torch.Tensor, ef: ErrorFeedback, be: Backend) -> tuple[torch.Tensor, torch.Tensor, float]:
    """The flattened tensor (a view when contiguous), its packed worker signs (n, C/8) and s_r.
    Nothing is modified."""
    n, numel = be.world_size, tensor.numel()
    signs = torch.empty(n, chunk_size(numel, n) // 8, dtype=torch.uint8, device=tensor.device)
    worker = ef.worker_error.to(tensor.device) if ef.worker_error is not None else None
    flat = tensor.detach().reshape(-1)
    sum_sq = codec.codec_for(tensor.device).worker_scan(flat, worker, signs.view(-1))
    return flat, signs, codec.rms_scale(sum_sq, numel)


def _exact_rows(tensor: torch.Tensor, ef: ErrorFeedback, be: Backend) -> tuple[torch.Tensor, torch.Tensor, float]:
    """For an uncompressed call: the flattened tensor, its fp32 chunks as bytes (n, 4C) and
    max |x|, which bounds the sums as s_r does (NaN/inf when x is not finite)."""
    n, numel = be.world_size, tensor.numel()
    flat = tensor.detach().reshape(-1)
    rows = torch.zeros(n, chunk_size(numel, n), dtype=torch.float32, device=tensor.device)
    rows.view(-1)[:numel].copy_(flat)
    return flat, rows.view(torch.uint8), largest_magnitude(flat)


def check_arguments(
    tensor: torch.Tensor, ef: ErrorFeedback, be: Backend, op: str, part: Callable[[int], tuple[int, int]] | None = None
) -> None:
    """This rank's own checks of a call (TypeError/ValueError); `ef` serves the (numel,
    world_size) `part(tensor.numel())`, by default (tensor.numel(), be.world_size)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"compressed_allreduce takes a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in FLOAT_DTYPES:
        raise TypeError(f"compressed_allreduce takes float32, float16 or bfloat16 tensors, got {tensor.dtype}")
    if not isinstance(ef, ErrorFeedback):
        raise TypeError(f"error_feedback must be a compcomm.ErrorFeedback, got {type(ef).__name__}")
    if op not in OPS:
        raise ValueError(f"op must be 'mean' or 'sum', got {op!r}")
    if not be.serves(tensor.device):
        raise ValueError(
            f"the {be.name} backend cannot reduce tensors on {tensor.device} "
            f"(it serves {be.device.type}); move the tensor or pick another backend"
        )
    if _overlaps(tensor):
        raise ValueError(
            f"the tensor's elements overlap in memory (shape {tuple(tensor.shape)}, strides "
            f"{tensor.stride()}, e.g. from expand()); the result cannot be written back: "
            "pass a tensor that owns its elements (.clone())"
        )
    why = ef.mismatch(*(part(tensor.numel()) if part else (tensor.numel(), be.world_size)))
    if why:
        raise ValueError(why)


def _overlaps(tensor: torch.Tensor) -> bool:
    """Whether two indices of the tensor can address the same element (strides alone decide:
    sorted by stride, each dimension must step past everything the smaller ones span)."""
    dims = sorted((stride, size) for size, stride in zip(tensor.shape, tensor.stride()) if size > 1)
    span = 0
    for stride, size in dims:
        if stride <= span:
            return True
        span += stride * (size - 1)
    return False


class _Unreadable(list):
    """An empty list standing for an argument this rank could not read as a sequence: raising at
    once would leave the other ranks waiting in phase 0, so `_check_pairs` raises `error` there,
    where it reaches every rank."""

    def __init__(self, error: Exception) -> None:
        super().__init__()
        self.error = error


def _as_list(values: object, name: str) -> list:
    """`list(values)`, or an `_Unreadable` when it is not a sequence (an agreed error in phase 0)."""
    if isinstance(values, (str, bytes, torch.Tensor, ErrorFeedback)) or not hasattr(values, "__iter__"):
        return _Unreadable(TypeError(f"{name} must be a sequence (list or tuple), got {type(values).__name__}"))
    return list(values)


def _as_outs(error_feedbacks_out: object) -> list | None:
    """The output ErrorFeedbacks of a call: None (the inputs take the errors) or `_as_list`'s."""
    return None if error_feedbacks_out is None else _as_list(error_feedbacks_out, "error_feedbacks_out")


def _check_pairs(tensors: list[torch.Tensor], efs: list[ErrorFeedback], outs: list[ErrorFeedback] | None) -> None:
    for given in (tensors, efs, outs):
        if isinstance(given, _Unreadable):
            raise given.error
    if len(tensors) != len(efs) or not tensors:
        raise ValueError(
            f"need one ErrorFeedback per tensor and at least one tensor, got "
            f"{len(tensors)} tensors and {len(efs)} ErrorFeedbacks"
        )
    if len({id(ef) for ef in efs}) != len(efs):
        raise ValueError("the same ErrorFeedback was passed for two tensors of one call; use one per tensor")
    if outs is None:
        return
    if len(outs) != len(efs):
        raise ValueError(f"need one output ErrorFeedback per tensor, got {len(outs)} for {len(efs)} tensors")
    for out in outs:
        if not isinstance(out, ErrorFeedback):
            raise TypeError(f"error_feedback_out must be a compcomm.ErrorFeedback, got {type(out).__name__}")
    sources = {id(ef) for ef in efs}
    others = [id(out) for out, ef in zip(outs, efs) if out is not ef]
    if len({id(out) for out in outs}) != len(outs) or sources.intersection(others):
        raise ValueError(
            "an output ErrorFeedback is also another tensor's input or output in this call; "
            "give each tensor its own (or its input itself)"
        )


def _raise_if_rejected(headers: np.ndarray, calls: np.ndarray, failure: Exception | None, be: Backend) -> None:
    """Raise the same error on every rank if any rank's call is invalid or would overflow."""
    first = headers[:, 0]
    bad = np.flatnonzero(first["code"])
    if bad.size:
        rank = int(bad[0])
        message = gather_messages(str(failure) if failure else "", be)[rank]
        raise ERRORS[int(first["code"][rank]) - 1](f"rank {rank}: {message}") from failure
    if (headers["digest"] != headers["digest"][:1]).any():
        raise ValueError(_disagreement(_all_gather_records(calls[:1] if headers.shape[1] == 1 else calls, be)))
    finite = np.isfinite(headers["scale"]) & np.isfinite(headers["server_max"])
    if not finite.all():
        raise NonFiniteError(
            f"non-finite values (NaN/Inf) in the input or error state of rank(s) "
            f"{np.flatnonzero(~finite.all(axis=1)).tolist()}; nothing was reduced and no "
            "error state changed"
        )
    for i in range(headers.shape[1]):
        _check_headroom(headers[:, i], calls[i])


def _disagreement(calls: np.ndarray) -> str:
    """What the ranks disagree on, from everyone's CALL records (fetched on this failure path only)."""
    if (calls["count"] != calls["count"][:1]).any():
        return (
            f"ranks disagree on the number of tensors in the call (per rank: {calls['count'][:, 0].tolist()}); "
            "nothing was reduced"
        )
    for field in ("seq", "numel", "op", "dtype", "exact", "tag"):
        differs = np.flatnonzero((calls[field] != calls[field][:1]).any(axis=0))
        if differs.size:
            column = calls[field][:, int(differs[0])].tolist()
            break
    else:  # the digests differ but no field does: a corrupted header
        return "the ranks' call headers differ; nothing was reduced"
    if field == "numel":
        return (
            f"ranks passed tensors of different sizes (numel per rank: {column}); "
            "every rank must reduce the same number of elements"
        )
    shown = {"op": lambda v: OPS[v], "dtype": lambda v: str(FLOAT_DTYPES[v]).replace("torch.", "")}
    values = [shown[field](v) for v in column] if field in shown else column
    what = {
        "seq": "call sequence numbers on this group",
        "op": "op",
        "dtype": "dtype",
        "exact": "compression (1 = uncompressed)",
        "tag": "ErrorFeedback tags",
    }[field]
    hint = {
        "seq": "; every rank must make the same compcomm calls on a group in the same order",
        "exact": "; pass the same min_compress_bytes on every rank",
        "tag": "; the ranks paired different ErrorFeedbacks (async calls submitted in different "
        "orders?): submit calls in the same order on every rank",
    }.get(field, "")
    return f"ranks disagree on the call's {what} (per rank: {values}){hint}; nothing was reduced"


def _check_headroom(headers: np.ndarray, call: np.void) -> None:
    """NonFiniteError when the server sums of this tensor could leave fp32 or the output dtype."""
    total = float(np.sum(headers["scale"].astype(np.float64)))
    divisor = len(headers) if OPS[int(call["op"])] == "mean" else 1
    largest = min(_LARGEST[torch.float32], _LARGEST[FLOAT_DTYPES[int(call["dtype"])]]) * _HEADROOM
    peak = total / divisor + float(np.max(headers["server_max"].astype(np.float64)))
    if total >= _LARGEST[torch.float32] * _HEADROOM or peak >= largest or not math.isfinite(peak):
        raise NonFiniteError(
            f"the reduction would overflow: the ranks' scales sum to {total:.3e} and the server values could "
            f"reach {peak:.3e}, beyond the {largest:.3e} that fp32 and the tensor's dtype hold; nothing was "
            "reduced and no error state changed (scale the tensor down)"
        )


def gather_messages(text: str, be: Backend) -> list[str]:
    """All-gather each rank's failure text (only on the failure path, so it costs nothing normally)."""
    raw = text.encode()[:_MESSAGE_BYTES].ljust(_MESSAGE_BYTES, b"\0")
    out = torch.empty(be.world_size, _MESSAGE_BYTES, dtype=torch.uint8, device=be.device)
    be.all_gather(torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(be.device), out)
    return [bytes(row).rstrip(b"\0").decode(errors="replace") for row in out.cpu().numpy()]

"""Phase 0, shared by every schedule: whether a call goes ahead, decided alike on every rank.

A compcomm call may only change a tensor or an error state once every rank knows that every
rank's part of it is valid. So each schedule starts with this agreement, before anything is
modified:

1. This rank's own checks of its arguments (`check_arguments`: TypeError/ValueError) and the
   schedule's local scan of each tensor (its scale, which is NaN/inf when the input or error
   state is not finite). A failure is not raised at once, which would leave the other ranks
   waiting: it travels as a code in the rank's `HEADER`.
2. One exchange of every rank's headers: an all-to-all whose slot j also carries the first bytes
   of this rank's data for rank j (`FOLD_BYTES`), or an all-gather.
3. The verdict, computed from the same bytes on every rank, so raised alike everywhere: a rank's
   own error (`ERRORS`, with that rank's message), ranks disagreeing on the call (`CALL`: count,
   sequence number, numel, op, dtype, ErrorFeedback tag, exactness, schedule), non-finite values
   (`NonFiniteError`), or sums that could leave fp32 or the result's dtype (`NonFiniteError`).

A schedule that sends its data while it measures it (phase 1 during the scan) runs step 2 in two
halves: `agree_on_arguments` (the digests and the checks' codes) before any data travels, and
`agree_on_measures` (the bounds and the measures' codes) once it is measured, before anything
is modified.

Slots have the same size on every rank whatever the arguments (a header plus the room that the
group's previous accepted call agreed on), so ranks passing different sizes are told so instead
of hanging. `raise_agreed` is the same verdict for a single failure outside a payload call (a
composite schedule's second level, checkpoint loading, the optimizers' small collectives).

`CallSpec` is a call as every schedule reads it: the tensors, one ErrorFeedback each, where the
errors after the call go (`into`), the op, which tensors go exact, and the dtype each result ends
in. The error commit is the schedules' one rule: the error state is written only after the
verdict, into `spec.into(i)`, which is the input ErrorFeedback itself unless the caller gave an
`error_feedback_out` (the optimizers and the DDP hook keep the old state until a whole step
succeeded).
"""

from __future__ import annotations

import math
import weakref
import zlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from .backends import Backend
from .backends.base import AGREED
from .backends.ordering import Channel
from .error_feedback import DROPPED, ErrorFeedback, Served
from .errors import NonFiniteError
from .layout import is_integer
from .tensor_memory import Span, any_in, overlaps_itself, share_elements, span

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
OPS = ("mean", "sum")
SCHEDULES = ("allreduce", "hierarchical", "reduce_scatter")
"""The schedules a call's header names, so that ranks running different collectives in the same
turn on a group are told so."""

CALL = np.dtype(
    [
        ("count", "<i8"),  # tensors in the call (coalesced calls carry several)
        ("seq", "<i8"),  # the call's number on the group: equal on every rank unless out of step
        ("numel", "<i8"),
        ("tag", "<u4"),  # ErrorFeedback.fingerprint
        ("op", "u1"),  # index in OPS
        ("dtype", "u1"),  # index in FLOAT_DTYPES
        ("exact", "u1"),  # 1 when reduced exactly (below min_compress_bytes)
        ("schedule", "u1"),  # index in SCHEDULES
        ("limit", "<f4"),  # CallSpec.limits: the largest result magnitude the caller takes (inf: none)
    ]
)
"""What every rank must agree on, per tensor. Only its digest travels, unless the digests differ."""

HEADER = np.dtype(
    [
        ("scale", "<f4"),  # the schedule's bound on this rank's contribution (inf/NaN when not finite)
        ("server_max", "<f4"),  # max |e_s| of this rank's server error (bounds the server sums)
        ("digest", "<u4"),  # crc32 of the tensor's CALL record
        ("code", "<i4"),  # 0, or `error_code` of the error this rank's own checks raised
    ]
)
"""Phase 0's per-tensor wire format (16 bytes per tensor and rank)."""

FOLD_BYTES = 128 * 1024
"""The most bytes per rank and slot that phase 0's all-to-all carries besides the header. Slots
have the same size on every rank whatever the arguments: a HEADER plus the room of the group's
previous accepted 1-bit call (its first tensor's row width, at most FOLD_BYTES / n; none before
the group's first one), which every rank knows alike. So a repeated call whose rows fit costs one
collective latency fewer, a larger call sends the rest afterwards, and no 1-bit call carries more
padding than its predecessor's rows. Exact calls (fp32 rows, 32x wider) leave the room as it was,
so that a warm-up does not make the 1-bit calls after it carry padding. FOLD_BYTES is about one
latency's worth of bytes on a 10 Gbit/s link."""

ERRORS: tuple[type[Exception], ...] = (TypeError, ValueError, NonFiniteError, RuntimeError, ImportError)
"""Errors carried by index (`error_code`); any other type travels as RuntimeError."""

_MESSAGE_BYTES = 1024
_HEADROOM = 1.0 - 2.0**-10  # fp32 rounding of the partial sums stays well inside this
_LARGEST = {dtype: float(torch.finfo(dtype).max) for dtype in FLOAT_DTYPES}


# ----------------------------------------------------------------------------------- the call


class _NotASequence(list):
    """Stands for an argument this rank could not read as a sequence: raising at once would
    leave the other ranks waiting in phase 0, so the agreement raises `error` there instead,
    where it reaches every rank."""

    def __init__(self, error: Exception) -> None:
        super().__init__()
        self.error = error


def as_list(values: object, name: str) -> list:
    """`list(values)`, or a `_NotASequence` (an agreed TypeError in phase 0) when it is not one."""
    if isinstance(values, (str, bytes, torch.Tensor, ErrorFeedback)) or not hasattr(values, "__iter__"):
        return _NotASequence(TypeError(f"{name} must be a sequence (list or tuple), got {type(values).__name__}"))
    return list(values)


@dataclass
class CallSpec:
    """One call of a compressed collective, as every schedule reads it.

    `exact` fixes which tensors go uncompressed (a composite's inner level, where the outer
    level decided); otherwise `min_compress_bytes` decides, per tensor, during the local checks.
    `result_dtypes` are the dtypes the results end in when not the tensors' own (a composite
    reducing fp32 parts of a half-precision tensor), for the overflow verdict. `outputs` are
    where a collective that does not work in place writes (a reduce-scatter's shards).
    `formed` gives, per tensor, an (addend, divisor) that the worker scan applies as it reads
    the tensor, so that the call reduces (tensor + addend) / divisor, which is never written
    out (a hierarchical node's mean, read in place from its ranks' blocks); only for a
    compressed tensor whose scan writes x' (`ErrorFeedback.scan_writes_x_prime`), since the
    other paths read the tensor itself.
    `limits` caps, per tensor, the magnitude its result may reach, below what fp32 and its dtype
    hold: for a caller that applies the result in a further step which must stay finite
    (DiLoCo's outer step); a call whose bound reaches it is refused like an overflow. Every
    rank must pass the same limits (they are part of the call's digest).
    `refused` is an error this rank found before the call, refused in its agreement on every
    rank: what its `backend=` argument raised (`resolve_for_call`; the call then runs on the
    default transport only to refuse it), or a caller's own check (`compcomm.fsdp`: a module
    whose gradients changed layout).
    `owner` is the rank the error feedback records and checks (`ErrorFeedback.rank`) where it is
    not this process's rank in the schedule's group: a composite's rank among all its ranks,
    since the node's ranks reduce different parts over the same group across nodes.
    """

    tensors: list[torch.Tensor]
    error_feedbacks: list[ErrorFeedback]
    op: str = "mean"
    outs: list[ErrorFeedback] | None = None
    min_compress_bytes: int | None = None
    exact: list[bool] | None = None
    result_dtypes: list[torch.dtype] | None = None
    outputs: list[torch.Tensor] | None = None
    formed: list[tuple[torch.Tensor | None, float]] | None = None
    limits: list[float] | None = None
    refused: Exception | None = None
    owner: int | None = None

    @classmethod
    def of(
        cls,
        tensors: object,
        error_feedbacks: object,
        op: str = "mean",
        outs: object = None,
        min_compress_bytes: int | None = None,
    ) -> CallSpec:
        """A call from a user's arguments, read leniently: what is not a sequence becomes an
        agreed TypeError in phase 0 rather than a local one."""
        spec = cls(
            as_list(tensors, "tensors"),
            as_list(error_feedbacks, "error_feedbacks"),
            op,
            None if outs is None else as_list(outs, "error_feedbacks_out"),
            min_compress_bytes,
        )
        for tensor, ef in zip(spec.tensors, spec.error_feedbacks):
            if isinstance(ef, ErrorFeedback) and isinstance(tensor, torch.Tensor):
                DROPPED.count_call(ef, tensor.numel())
        return spec

    def owner_over(self, be: Backend) -> int:
        """The rank the error feedback of a call over `be` records (see `owner`)."""
        return be.rank if self.owner is None else self.owner

    def into(self, i: int) -> ErrorFeedback:
        """Where tensor i's errors after the call go: its output ErrorFeedback, or its own."""
        return self.error_feedbacks[i] if self.outs is None else self.outs[i]

    def reduced_exactly(self, i: int) -> bool:
        """Whether tensor i goes uncompressed (ValueError for a bad `min_compress_bytes`)."""
        if self.exact is not None:
            return self.exact[i]
        limit = self.min_compress_bytes
        if limit is None:
            return False
        if not is_integer(limit) or limit < 0:
            raise ValueError(
                f"min_compress_bytes must be None or an integer number of bytes >= 0, "
                f"got {type(limit).__name__} {limit!r}"
            )
        tensor = self.tensors[i]
        return tensor.numel() * tensor.element_size() < limit

    def formed_by(self, i: int) -> tuple[torch.Tensor | None, float]:
        """Tensor i's (addend, divisor) in the worker scan: (None, 1.0) when it is reduced as it is."""
        return (None, 1.0) if self.formed is None else self.formed[i]

    def limit(self, i: int) -> float:
        """Tensor i's limit as its CALL record holds it (fp32; inf: none, or beyond fp32)."""
        limit = math.inf if self.limits is None else float(self.limits[i])
        return limit if limit <= _LARGEST[torch.float32] else math.inf

    def result_dtype(self, i: int) -> torch.dtype:
        return self.tensors[i].dtype if self.result_dtypes is None else self.result_dtypes[i]

    def check_pairs(self) -> None:
        """The call's structure (first, what this rank refused, if anything): one ErrorFeedback
        (and output) per tensor, none shared, and no tensor or output in the memory of an error
        state (the result would overwrite the errors)."""
        if self.refused is not None:
            raise self.refused
        for given in (self.tensors, self.error_feedbacks, self.outs):
            if isinstance(given, _NotASequence):
                raise given.error
        tensors, efs, outs = self.tensors, self.error_feedbacks, self.outs
        if len(tensors) != len(efs) or not tensors:
            raise ValueError(
                f"need one ErrorFeedback per tensor and at least one tensor, got "
                f"{len(tensors)} tensors and {len(efs)} ErrorFeedbacks"
            )
        if len({id(ef) for ef in efs}) != len(efs):
            raise ValueError("the same ErrorFeedback was passed for two tensors of one call; use one per tensor")
        given = [t for t in tensors if isinstance(t, torch.Tensor) and t.numel()]
        spans = [span(t) for t in given]
        if share_elements(given, spans):
            raise ValueError(
                "two tensors of one call share memory (views of one buffer with elements in common, "
                "or one tensor passed twice): each result would overwrite the other's; pass tensors "
                "of their own (.clone())"
            )
        written = [span(t) for t in self.outputs or () if isinstance(t, torch.Tensor) and t.numel()]
        _check_apart_from_errors(spans + written, efs, outs)
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


def _check_apart_from_errors(spans: list[Span], efs: list[ErrorFeedback], outs: list[ErrorFeedback] | None) -> None:
    """ValueError when a tensor (of `spans`) lies in the memory of one of the call's error states
    (e.g. an ErrorFeedback's `worker_error` read while it is held as e itself, passed as the
    input): the result would be written over the errors that the call commits."""
    states = [ef for ef in [*efs, *(outs or [])] if isinstance(ef, ErrorFeedback)]
    if any_in(spans, [t for ef in states for t in ef.held_buffers()]):
        raise ValueError(
            "a tensor of the call shares memory with an ErrorFeedback's error state (its "
            "worker_error or server_error): the result would overwrite the errors; reduce a "
            "copy of it (.clone())"
        )


def check_arguments(
    tensor: torch.Tensor, ef: ErrorFeedback, be: Backend, op: str, serves: Callable[[int], Served]
) -> None:
    """This rank's own checks of one tensor of a call (TypeError/ValueError); `ef` must hold
    errors of the (numel, world_size, layout, rank) that `serves(numel)` gives, or none yet."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"compressed collectives take a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in FLOAT_DTYPES:
        raise TypeError(f"compressed collectives take float32, float16 or bfloat16 tensors, got {tensor.dtype}")
    if not isinstance(ef, ErrorFeedback):
        raise TypeError(f"error_feedback must be a compcomm.ErrorFeedback, got {type(ef).__name__}")
    if op not in OPS:
        raise ValueError(f"op must be 'mean' or 'sum', got {op!r}")
    if not be.serves(tensor.device):
        raise ValueError(
            f"the {be.name} backend cannot reduce tensors on {tensor.device} "
            f"(it serves {be.device.type}); move the tensor or pick another backend"
        )
    if overlaps_itself(tensor):
        raise ValueError(
            f"the tensor's elements overlap in memory (shape {tuple(tensor.shape)}, strides "
            f"{tensor.stride()}, e.g. from expand()); the result cannot be written back: "
            "pass a tensor that owns its elements (.clone())"
        )
    why = ef.mismatch(*serves(tensor.numel()))
    if why:
        raise ValueError(why)


# ----------------------------------------------------------------------------------- phase 0


@dataclass
class Measured:
    """What a schedule's local pass found of one tensor, for the headers."""

    bound: float  # bounds what this rank adds to any output element (s_r, max |x|, ...); NaN/inf if not finite
    server_max: float = 0.0  # max |e_s| this rank's served outputs carry on top (0 without server error)
    rows: torch.Tensor | None = None  # (n, W) bytes for ranks 0..n-1, the first bytes of which phase 0 carries


@dataclass
class Agreement:
    """The accepted call, as every rank sees it."""

    headers: np.ndarray  # (n, count) HEADER records of every rank
    early: torch.Tensor | None  # (n, e): the first e bytes rank r sent this one of tensor 0's rows

    def bounds(self, i: int) -> np.ndarray:
        """Every rank's `Measured.bound` of tensor i, as fp32 (the scales s_r of a 1-bit call)."""
        return self.headers["scale"][:, i].astype(np.float32)


class _GroupMemory:
    """What every rank of a group sets alike from the accepted calls on it (calls pair by
    position, so this stays equal across ranks even when their arguments differ)."""

    def __init__(self) -> None:
        self.fold_room = 0
        self.row_width = 0


_memory: weakref.WeakKeyDictionary[Channel, _GroupMemory] = weakref.WeakKeyDictionary()


def _group_memory(channel: Channel) -> _GroupMemory:
    if channel not in _memory:
        _memory[channel] = _GroupMemory()
    return _memory[channel]


def agree_on_call(
    spec: CallSpec,
    be: Backend,
    schedule: str,
    sequence: int,
    measure: Callable[[int], Measured],
    serves: Callable[[int], Served],
    fold: bool = True,
) -> Agreement:
    """Phase 0 of `spec` over `be` for `schedule`, the call numbered `sequence` on the group.

    `measure(i)` runs the schedule's local pass over tensor i (after `check_arguments`, with the
    ErrorFeedback serving `serves(numel)`: numel, world size, layout and rank); with `fold`, the first
    tensor's rows travel in the headers' all-to-all as far as the agreed room holds. Returns the
    agreement, or raises the agreed error on every rank of `be` with nothing modified."""
    calls, headers, failure = _check_call(spec, be, schedule, sequence, serves)
    first_rows: torch.Tensor | None = None
    if failure is None:
        failure, first_rows = _measure(spec, headers, measure)
    memory = _group_memory(be.channel)
    with _refusal_noted(spec):
        everyone, early = _exchange(headers, be, first_rows, memory.fold_room if fold else None)
    _raise_if_rejected(everyone, calls, failure, be, spec.owner is None)
    if fold:
        _remember_rows(memory, calls, first_rows, be.world_size)
    return Agreement(everyone, early)


def agree_on_arguments(
    spec: CallSpec, be: Backend, schedule: str, sequence: int, serves: Callable[[int], Served]
) -> np.ndarray:
    """The first half of phase 0 in two halves, for a schedule that sends its rows while it
    measures them (`Backend.all_to_all_as_produced`): this rank's checks and every rank's digest
    in one exchange, so that the ranks agree on the sizes before any row travels. Returns the
    call's records, for `agree_on_measures`, or raises the agreed error on every rank."""
    calls, headers, failure = _check_call(spec, be, schedule, sequence, serves)
    with _refusal_noted(spec):
        everyone, _ = _exchange(headers, be, None, None)
    _raise_if_rejected(everyone, calls, failure, be, spec.owner is None)
    return calls


def agree_on_measures(spec: CallSpec, be: Backend, calls: np.ndarray, measure: Callable[[int], Measured]) -> Agreement:
    """The second half: `measure(i)` of every tensor, every rank's bounds in one all-gather, and
    the verdict on them (a rank's failed measure, non-finite values, overflow), raised alike on
    every rank before anything is modified. The rows already sent change nothing."""
    headers = _headers(calls)
    failure, first_rows = _measure(spec, headers, measure)
    everyone = _all_gather_records(headers, be)
    _raise_if_rejected(everyone, calls, failure, be, spec.owner is None)
    _remember_rows(_group_memory(be.channel), calls, first_rows, be.world_size)
    return Agreement(everyone, None)


@contextmanager
def _refusal_noted(spec: CallSpec) -> Iterator[None]:
    """An exchange of a call this rank refused (`CallSpec.refused`), run to tell the other ranks:
    when they are not there (for a refused backend: theirs runs over other ranks or another
    transport than the default one this rank took) it fails at the transport's timeout, as a
    RuntimeError that says why this rank was there."""
    try:
        yield
    except Exception as exc:
        if spec.refused is None:
            raise
        raise RuntimeError(
            f"this rank refused the call ({type(spec.refused).__name__}: {spec.refused}) and ran its agreement to "
            "refuse it on every rank, but the other ranks were not there (a refused backend= runs it over the "
            f"default transport, which theirs may not be): {type(exc).__name__}: {exc}"
        ) from exc


def previous_row_width(be: Backend) -> int:
    """The row width in bytes of the first tensor of the group's previous accepted 1-bit call
    (0 before the first): known alike on every rank, so a schedule may choose by it how to run
    the next call before any exchange."""
    return _group_memory(be.channel).row_width


def _check_call(
    spec: CallSpec, be: Backend, schedule: str, sequence: int, serves: Callable[[int], Served]
) -> tuple[np.ndarray, np.ndarray, Exception | None]:
    """This rank's checks of the call: its CALL records, its headers (digests, and the code of
    the error the checks raised, if any) and that error."""
    count = len(spec.tensors)
    calls = np.zeros(max(count, 1), dtype=CALL)  # one record at least: phase 0 always sends one
    calls["count"], calls["seq"], calls["schedule"] = count, sequence, SCHEDULES.index(schedule)
    failure: Exception | None = None
    try:
        spec.check_pairs()
        for i, (tensor, ef) in enumerate(zip(spec.tensors, spec.error_feedbacks)):
            check_arguments(tensor, ef, be, spec.op, serves)
            calls["exact"][i] = spec.reduced_exactly(i)
            record = calls[i]
            record["numel"], record["tag"], record["op"] = tensor.numel(), ef.fingerprint, OPS.index(spec.op)
            record["dtype"] = FLOAT_DTYPES.index(spec.result_dtype(i))
            record["limit"] = spec.limit(i)
    except Exception as exc:  # reported to every rank in the exchange, then raised everywhere
        failure = exc
    headers = _headers(calls)
    if failure is not None:
        headers["code"] = error_code(failure)
    return calls, headers, failure


def _headers(calls: np.ndarray) -> np.ndarray:
    """One header per CALL record, carrying its digest: what the ranks compare to agree on the call."""
    headers = np.zeros(len(calls), dtype=HEADER)
    headers["digest"] = [zlib.crc32(record.tobytes()) for record in calls]
    return headers


def _measure(
    spec: CallSpec, headers: np.ndarray, measure: Callable[[int], Measured]
) -> tuple[Exception | None, torch.Tensor | None]:
    """`measure(i)` of every tensor into `headers`: the error it raised (its code then in the
    headers) and the first tensor's rows."""
    first_rows: torch.Tensor | None = None
    try:
        for i in range(len(spec.tensors)):
            measured = measure(i)
            headers["scale"][i], headers["server_max"][i] = measured.bound, measured.server_max
            if i == 0:
                first_rows = measured.rows
    except Exception as exc:  # reported to every rank in the exchange, then raised everywhere
        headers["code"] = error_code(exc)
        return exc, None
    return None, first_rows


def _remember_rows(memory: _GroupMemory, calls: np.ndarray, first_rows: torch.Tensor | None, n: int) -> None:
    """After an accepted call (so alike on every rank): its first tensor's row width, when 1-bit."""
    if first_rows is not None and not calls["exact"][0]:
        memory.fold_room = min(FOLD_BYTES // n, first_rows.shape[1])
        memory.row_width = first_rows.shape[1]


def exchange_rows(
    be: Backend, rows: torch.Tensor, early: torch.Tensor | None, meanwhile: Callable[[], None]
) -> torch.Tensor:
    """The rest of phase 0's folded all-to-all: (n, W), row r what rank r sent this one of
    `rows` (row j for rank j), given the `early` bytes phase 0 carried; the part it did not
    carry goes now, in one all-to-all, while `meanwhile()` runs."""
    done = 0 if early is None else early.shape[1]
    if done == rows.shape[1]:
        meanwhile()
        return early.contiguous() if early is not None else torch.empty_like(rows)
    rest = rows if done == 0 else rows[:, done:].contiguous()
    got = torch.empty_like(rest)
    in_flight = be.all_to_all(rest, got, async_op=True)
    meanwhile()
    in_flight.wait()
    return got if early is None else torch.cat([early, got], dim=1)


def error_code(exc: BaseException) -> int:
    """The code of an error that travels: 1 + its index in ERRORS (RuntimeError for the rest)."""
    return 1 + next((i for i, cls in enumerate(ERRORS) if type(exc) is cls), ERRORS.index(RuntimeError))


def _exchange(
    headers: np.ndarray, be: Backend, rows: torch.Tensor | None, room: int | None
) -> tuple[np.ndarray, torch.Tensor | None]:
    """Exchange the headers: (n, count) records, and the first tensor's early rows. The first
    record goes alone (in the folded all-to-all when `room` is given, or an all-gather), so that
    ranks disagreeing on the count (part of the digest) are caught before sizes differ."""
    if room is None:
        first, early = _all_gather_records(headers[:1], be), None
    else:
        first, early = _folded(headers[:1], rows, room, be)
    if len(headers) == 1 or (first["digest"] != first["digest"][:1]).any() or first["code"].any():
        return first, early
    return np.concatenate([first, _all_gather_records(headers[1:], be)], axis=1), early


def _folded(
    record: np.ndarray, rows: torch.Tensor | None, room: int, be: Backend
) -> tuple[np.ndarray, torch.Tensor | None]:
    """Phase 0's all-to-all: slot j carries `record` and the first bytes of rows[j], in the
    `room` every rank agreed on (see FOLD_BYTES), so no argument can make sizes differ. On the
    rows' device: the early rows it returns meet the tensor's other rows (a backend may serve
    tensors off its own device, as mpi serves CPU tensors on a GPU machine)."""
    n, head = be.world_size, HEADER.itemsize
    device = be.device if rows is None else rows.device
    send = torch.zeros(n, head + room, dtype=torch.uint8, device=device)
    send[:, :head] = torch.from_numpy(record.view(np.uint8).copy()).to(device)
    carried = 0 if rows is None else min(room, rows.shape[1])
    if carried:
        assert rows is not None
        send[:, head : head + carried].copy_(rows[:, :carried])
    recv = torch.empty_like(send)
    be.all_to_all(send, recv)
    records = recv[:, :head].cpu().numpy().view(HEADER).reshape(n, 1)
    return records, recv[:, head : head + carried] if carried else None


def _all_gather_records(records: np.ndarray, be: Backend) -> np.ndarray:
    send = torch.from_numpy(records.view(np.uint8).copy()).to(be.device)
    recv = torch.empty(be.world_size, send.numel(), dtype=torch.uint8, device=be.device)
    be.all_gather(send, recv)
    return recv.cpu().numpy().view(records.dtype).reshape(be.world_size, len(records))


def _raise_if_rejected(
    headers: np.ndarray, calls: np.ndarray, failure: Exception | None, be: Backend, in_world: bool
) -> None:
    """Raise the same error on every rank if any rank's call is invalid or would overflow.
    `in_world`: name the ranks with their world ranks too (a user's call, not the inner group of
    a composite, whose ranks' messages are agreed again over groups that map otherwise)."""
    first = headers[:, 0]
    bad = np.flatnonzero(first["code"])
    if bad.size:
        rank = int(bad[0])
        message = gather_messages(str(failure) if failure else "", be)[rank]
        raise _agreed(ERRORS[int(first["code"][rank]) - 1](f"{rank_named(be, rank, in_world)}: {message}")) from failure
    if (headers["digest"] != headers["digest"][:1]).any():
        raise ValueError(_disagreement(_all_gather_records(calls[:1] if headers.shape[1] == 1 else calls, be)))
    finite = np.isfinite(headers["scale"]) & np.isfinite(headers["server_max"])
    if not finite.all():
        raise NonFiniteError(
            f"non-finite values (NaN/Inf) in the input or error state of "
            f"{ranks_named(be, np.flatnonzero(~finite.all(axis=1)).tolist(), in_world)}; nothing was reduced and no "
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
    for field in ("schedule", "seq", "numel", "op", "dtype", "exact", "tag", "limit"):
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
    shown = {
        "op": lambda v: OPS[v],
        "dtype": lambda v: str(FLOAT_DTYPES[v]).replace("torch.", ""),
        "schedule": lambda v: SCHEDULES[v],
    }
    values = [shown[field](v) for v in column] if field in shown else column
    what = {
        "schedule": "collective",
        "seq": "call sequence numbers on this group",
        "op": "op",
        "dtype": "dtype",
        "exact": "compression (1 = uncompressed)",
        "tag": "ErrorFeedback tags, as CRC-32 digests",
        "limit": "largest result magnitude",
    }[field]
    hint = {
        "schedule": "; every rank must make the same compcomm calls on a group in the same order",
        "seq": "; every rank must make the same compcomm calls on a group in the same order",
        "exact": "; pass the same min_compress_bytes on every rank",
        "tag": "; the ranks paired different ErrorFeedbacks (async calls submitted in different "
        "orders?): submit calls in the same order on every rank (a tag is the place where the "
        "ErrorFeedback was made, unless given: ErrorFeedback(tag=...))",
    }.get(field, "")
    return f"ranks disagree on the call's {what} (per rank: {values}){hint}; nothing was reduced"


def _check_headroom(headers: np.ndarray, call: np.void) -> None:
    """NonFiniteError when the sums of this tensor could leave fp32, the result's dtype or the
    call's limit: with B = sum_r bound_r, partial sums stay below B and each output below B/n
    (mean) or B (sum), plus max |e_s|."""
    total = float(np.sum(headers["scale"].astype(np.float64)))
    divisor = len(headers) if OPS[int(call["op"])] == "mean" else 1
    largest = min(_LARGEST[torch.float32], _LARGEST[FLOAT_DTYPES[int(call["dtype"])]]) * _HEADROOM
    peak = total / divisor + float(np.max(headers["server_max"].astype(np.float64)))
    limit = float(call["limit"])
    if total >= _LARGEST[torch.float32] * _HEADROOM:
        before_mean = " (the sum comes before op='mean' divides it)" if divisor > 1 else ""
        raise NonFiniteError(
            f"the reduction would overflow: the ranks' scales sum to {total:.3e}, beyond the "
            f"{_LARGEST[torch.float32]:.3e} that the servers' fp32 partial sums hold{before_mean}; nothing was "
            "reduced and no error state changed (scale the tensor down)"
        )
    if peak >= largest or not math.isfinite(peak):
        raise NonFiniteError(
            f"the reduction would overflow: the server values could reach {peak:.3e}, beyond the {largest:.3e} "
            "that fp32 and the result's dtype hold; nothing was reduced and no error state changed (scale "
            "the tensor down)"
        )
    if peak >= limit:
        raise NonFiniteError(
            f"the result could reach {peak:.3e}, beyond the {limit:.3e} that the caller's next step takes "
            "without overflowing; nothing was reduced and no error state changed"
        )


# ----------------------------------------------------------------------------------- verdicts


def gather_messages(text: str, be: Backend) -> list[str]:
    """All-gather each rank's failure text (only on a failure path, so it costs nothing normally)."""
    raw = text.encode()[:_MESSAGE_BYTES].ljust(_MESSAGE_BYTES, b"\0")
    out = torch.empty(be.world_size, _MESSAGE_BYTES, dtype=torch.uint8, device=be.device)
    be.all_gather(torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(be.device), out)
    return [bytes(row).rstrip(b"\0").decode(errors="replace") for row in out.cpu().numpy()]


def raise_agreed(failure: BaseException | None, be: Backend, context: str = "") -> None:
    """Raise on every rank of `be` if any rank has a `failure`: one small all-gather when none
    has. Every rank raises the class of the lowest failed rank's error (as `ERRORS` carries it),
    with that rank's message, `context` before it and the list of failed ranks when several."""
    agreed = agreed_failure(failure, be, context)
    if agreed is not None:
        raise agreed from failure


def agreed_failure(failure: BaseException | None, be: Backend, context: str = "") -> Exception | None:
    """What `raise_agreed` raises, returned instead (None when no rank has a failure): for a
    caller that must tell the ranks' agreed verdict from a failure of the transport itself. A
    failure that was itself agreed (over an inner group) already names its rank there, and
    keeps that name alone."""
    code = 0 if failure is None else error_code(failure)
    codes = torch.empty(be.world_size, 1, dtype=torch.uint8, device=be.device)
    be.all_gather(torch.tensor([code], dtype=torch.uint8, device=be.device), codes)
    failed = [r for r, c in enumerate(codes.view(-1).tolist()) if c]
    if not failed:
        return None
    first = failed[0]
    own = "" if failure is None or getattr(failure, AGREED, False) else f"rank {be.rank}: "
    message = gather_messages(f"{own}{failure or ''}", be)[first]
    ranks = f"rank(s) {failed} failed; " if len(failed) > 1 else ""
    return _agreed(ERRORS[int(codes[first, 0]) - 1](f"{context}{ranks}{message}"))


def rank_named(be: Backend, rank: int, in_world: bool) -> str:
    """ "rank r" of `be`'s group, with its rank in the whole world where that differs and
    `in_world` (a sub-group's messages otherwise name positions the user never numbered)."""
    world = be.world_ranks() if in_world else None
    return f"rank {rank}" if world is None else f"rank {rank} (world rank {world[rank]})"


def ranks_named(be: Backend, ranks: list[int], in_world: bool) -> str:
    """ "rank(s) [...]" of `be`'s group, as `rank_named`."""
    world = be.world_ranks() if in_world else None
    return f"rank(s) {ranks}" if world is None else f"rank(s) {ranks} (world rank(s) {[world[r] for r in ranks]})"


def _agreed(error: Exception) -> Exception:
    """`error`, marked as raised alike on every rank (`backends.base.AGREED`)."""
    setattr(error, AGREED, True)
    return error


def all_sum(values: Sequence[float], be: Backend) -> list[float]:
    """Element-wise sum over ranks of a few float64 numbers (exact for small integers): the
    optimizers' per-step verdicts (is some rank's gradient non-finite? did the order agree?)."""
    flat = torch.tensor(list(values), dtype=torch.float64, device=be.device)
    be.all_reduce(flat, "sum")
    return flat.tolist()


def all_max(values: Sequence[float], be: Backend) -> list[float]:
    """Element-wise maximum over ranks of a few numbers (NaN if any rank's is NaN)."""
    mine = torch.tensor(list(values), dtype=torch.float64, device=be.device)
    everyone = torch.empty(be.world_size, len(mine), dtype=torch.float64, device=be.device)
    be.all_gather(mine.view(torch.uint8), everyone.view(torch.uint8))
    return everyone.amax(dim=0).tolist()

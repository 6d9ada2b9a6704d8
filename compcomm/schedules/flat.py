"""The error-compensated 1-bit allreduce over one group of ranks, written once for every backend.

For world size n, rank r and N elements padded to M = ceil(N / 8n) * 8n, chunk C = M / n (rank j
serves elements [jC, (j+1)C), k_j = clamp(N - jC, 0, C) of them real):

    worker r:   x' = pad(x as fp32) + e_w        s_r = ||x'[:N]|| / sqrt(N)  (squares summed per
                                                  chunk, the chunks' sums in chunk order)
                e_w <- x' - s_r sign(x')          (0 on padding; held as (x', s_r) and
                                                   computed in the next call's scan when the
                                                   scan has a second buffer to write x' into)
    phase 0:    the agreement (`compcomm.agreement`): every rank's header (s_r, max |e_s|, a
                digest of the call, its own error if any), in an all-to-all whose slot j also
                carries the first bytes of the packed signs for server j
    phase 1:    all-to-all of the rest of the packed signs: rank j gets chunk j of each sign(x'_r)
                (none when phase 0 carried them all: repeated small calls). Where the backend
                sends rows one by one and the previous call had such rows, each chunk is sent as
                it is scanned, between phase 0's two halves (`_prepare_streaming`)
    server j:   y = (1/n) sum_r s_r sign(x'_r)[chunk j] + e_s      (no 1/n for op="sum")
                t_j = ||y[:k_j]|| / sqrt(k_j)  (0 when k_j = 0)
                e_s <- y - t_j sign(y)             (0 beyond the k_j real elements)
    phase 2:    all-gather of (t_j, packed sign(y_j)) in one collective
    output:     chunk j of the result is t_j sign(y_j) on every rank, in the tensor's dtype

sign(v) is +1 for v >= 0 (so for -0.0 too); bits are packed MSB-first, 1 meaning +1. Every rank
decodes the same bytes, so the result is bitwise identical on every rank and every backend.
Summed over calls, output + mean of the worker errors + the concatenated server errors equals
the sum of the true means: what one call leaves out, the next ones carry.

Phase 0 rejects a call on every rank alike before anything is modified; with B = sum_r s_r, the
server's fp32 partial sums stay below B and |y| below B/n (B for "sum") + max |e_s|, so a call
whose bound reaches the top of fp32 or of the output dtype is refused (NonFiniteError): a finite
input never yields a non-finite output or error state.

A tensor reduced exactly (below `min_compress_bytes`) takes the same phases and checks: phases
0/1 carry fp32 chunk j of x to server j, which sums the rows in rank order (then divides by n
for "mean"), and phase 2 all-gathers the sums. Its error feedback is neither used nor changed.

Per rank on the wire: about 2 (n-1)/n * M/8 bytes plus a header and a scale per server, against
2 (n-1)/n * 4N for a ring fp32 allreduce.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .. import codec
from ..agreement import (
    Agreement,
    CallSpec,
    Measured,
    agree_on_arguments,
    agree_on_call,
    agree_on_measures,
    exchange_rows,
    previous_row_width,
)
from ..backends import Backend
from ..backends.rank_order import sum_in_rank_order
from ..error_feedback import ALLREDUCE, ErrorFeedback, Served
from ..errors import largest_magnitude
from ..layout import chunk_size, real_count

SERVER_SCALE_BYTES = 4
"""Phase 2's message of server j: t_j as fp32 bytes, then the packed signs of sign(y_j)."""

Scanned = tuple[torch.Tensor, torch.Tensor, float, "torch.Tensor | None"]
"""A tensor's local pass: its flat view, its phase-1 rows, its bound (s_r, or max |x| when
reduced exactly) and its new x' (None: the errors are updated in a pass after the verdict)."""


def allreduce(spec: CallSpec, be: Backend) -> list[torch.Tensor]:
    """Run `spec` over `be`: phase 0, then phases 1 and 2 and the decode of every tensor."""
    for call in prepare(spec, be):
        call.commit()
    return spec.tensors


def prepare(spec: CallSpec, be: Backend) -> list[FlatCall]:
    """This rank's checks and worker scans, then phase 0 over `be`: the calls ready to
    `commit()`, or the agreed error raised on every rank with nothing modified. A composite
    schedule that must agree across another group before committing calls the two halves
    itself, inside its own turn on the channels (with `spec.outputs` when the results belong
    elsewhere than in the tensors: each is then decoded there, as phase 2 arrives).

    Where the backend sends rows one by one and the group's previous 1-bit call was that wide
    (`Backend.sends_row_by_row`: the ranks decide alike, before any exchange), the first
    tensor's phase 1 runs during its scan instead (`_prepare_streaming`)."""
    if be.sends_row_by_row(previous_row_width(be)):
        return _prepare_streaming(spec, be)
    scanned: dict[int, Scanned] = {}
    agreement = agree_on_call(
        spec, be, "allreduce", be.sequence_number(), _measure(spec, be, scanned), serves(be, spec.owner_over(be))
    )
    return _calls(spec, be, agreement, scanned, None)


def _prepare_streaming(spec: CallSpec, be: Backend) -> list[FlatCall]:
    """`prepare` with phase 0 in two halves and the first tensor's phase 1 sent as it is scanned.

    Phase 0a agrees on the call (sizes, op, dtypes, ...) before any row travels. Then the
    first tensor's chunks are scanned one by one, in the order the backend asks for them, each
    sent to its server as soon as it is packed; meanwhile the other tensors are scanned and
    phase 0b agrees on the bounds (s_r, max |e_s|) and on any rank's failed scan. A rejected call
    has sent signs that no server uses and changes nothing. A first tensor reduced exactly
    takes the ordinary phase 1 (its rows are the tensor itself: there is no scan to overlap)."""
    calls = agree_on_arguments(spec, be, "allreduce", be.sequence_number(), serves(be, spec.owner_over(be)))
    scanned: dict[int, Scanned] = {}
    if spec.reduced_exactly(0):
        agreement = agree_on_measures(spec, be, calls, _measure(spec, be, scanned))
        return _calls(spec, be, agreement, scanned, None)
    scan = WorkerScan(spec.tensors[0], spec.error_feedbacks[0], spec.into(0), be.world_size, *spec.formed_by(0))
    received = torch.empty_like(scan.rows)
    agreed: list[Agreement] = []
    measure = _measure(spec, be, scanned, first=scan)
    be.all_to_all_as_produced(
        scan.rows, received, scan.chunk, lambda: agreed.append(agree_on_measures(spec, be, calls, measure))
    )
    return _calls(spec, be, agreed[0], scanned, received)


def _measure(
    spec: CallSpec, be: Backend, scanned: dict[int, Scanned], first: WorkerScan | None = None
) -> Callable[[int], Measured]:
    """Phase 0's `measure`: tensor i's local pass, kept in `scanned`; the first tensor's is
    `first`'s result when given (its chunks scanned already, a failed one raised here)."""

    def measure(i: int) -> Measured:
        if i not in scanned:
            scanned[i] = first.result() if i == 0 and first is not None else _scan(spec, i, be.world_size)
        _, rows, bound, _ = scanned[i]
        server_max = 0.0 if spec.reduced_exactly(i) else spec.error_feedbacks[i].server_error_max()
        return Measured(bound, server_max, rows)

    return measure


def _calls(
    spec: CallSpec,
    be: Backend,
    agreement: Agreement,
    scanned: dict[int, Scanned],
    received: torch.Tensor | None,
) -> list[FlatCall]:
    """The accepted call's tensors, ready to commit; `received`: the first tensor's phase 1, done."""
    return [
        FlatCall(
            spec,
            i,
            be,
            agreement,
            flat,
            received if i == 0 and received is not None else rows,
            scale,
            spec.reduced_exactly(i),
            x_prime,
            sent=i == 0 and received is not None,
            output=None if spec.outputs is None else spec.outputs[i],
        )
        for i, (flat, rows, scale, x_prime) in sorted(scanned.items())
    ]


def serves(be: Backend, rank: int) -> Callable[[int], Served]:
    """What the ErrorFeedback of a numel-element tensor holds after a call over `be`:
    (elements, ranks, layout, the rank it records: `CallSpec.owner_over(be)`)."""
    return lambda numel: (numel, be.world_size, ALLREDUCE, rank)


def _scan(spec: CallSpec, i: int, n: int) -> Scanned:
    """Tensor i's local pass (see `Scanned`)."""
    if spec.reduced_exactly(i):
        addend, divisor = spec.formed_by(i)
        if addend is not None or divisor != 1.0:
            raise ValueError("a formed tensor cannot be reduced exactly: its rows are the tensor itself")
        flat, rows, bound = _exact_rows(spec.tensors[i], n)
        return flat, rows, bound, None
    scan = WorkerScan(spec.tensors[i], spec.error_feedbacks[i], spec.into(i), n, *spec.formed_by(i))
    for j in range(n):
        scan.chunk(j)
    return scan.result()


CHUNKED_SCAN_ELEMENTS = 1 << 20
"""A tensor whose chunks hold more elements than this is scanned chunk by chunk, so that a
transport may send each chunk's signs as soon as they are packed (chunks of more than 128 KiB of
signs, as of a call of more than 16 MiB of fp32 on 4 ranks: where gloo sends rows one by one,
`DIRECT_GATHER_BYTES`); a smaller one in one pass, which saves a few microseconds per chunk that
a small call would notice. The rule depends on N and n alone, so every backend gets the same bits."""


class WorkerScan:
    """A tensor's worker pass: chunk j's packed signs of x' = x + e_w (row j of `rows`), and the
    new x' where `into` lends a buffer for it (None: the call updates the errors in a pass of its
    own, after the verdict). The error state is not modified (an `into` other than the input's
    ErrorFeedback gives its errors up).

    Chunks of more than CHUNKED_SCAN_ELEMENTS are scanned one by one, in any order, and s_r adds
    their sums of squares in chunk order, so that a call scanning its chunks as the transport
    asks gets the same bits as one scanning them in order; smaller tensors are scanned whole at
    the first `chunk` call. `chunk` never raises: a failure is kept for `result`, which raises
    it where phase 0 carries it to every rank (the rows then travel as they are, and the call is
    rejected). With an `addend` or a `divisor` other than 1, x is (tensor + addend) / divisor,
    formed as the scan reads it (`CallSpec.formed`)."""

    def __init__(
        self,
        tensor: torch.Tensor,
        ef: ErrorFeedback,
        into: ErrorFeedback,
        n: int,
        addend: torch.Tensor | None = None,
        divisor: float = 1.0,
    ) -> None:
        numel = tensor.numel()
        self.tensor, self.ef, self.into = tensor, ef, into
        self.addend, self.divisor = addend, divisor
        self.n, self.numel, self.size = n, numel, chunk_size(numel, n)
        self.whole = self.size <= CHUNKED_SCAN_ELEMENTS
        self.rows = torch.empty(n, self.size // 8, dtype=torch.uint8, device=tensor.device)
        self.sums = [0.0] * n
        self.failure: Exception | None = None
        self.started = False
        self.flat = self.tensor.detach()
        self.worker: torch.Tensor | None = None
        self.pending_scale: float | None = None
        self.x_prime: torch.Tensor | None = None

    def _start(self) -> None:
        """What the first chunk needs: the flat input, the error state and the buffer for x'."""
        if self.started:
            return
        device = self.tensor.device
        self.flat = self.tensor.detach().reshape(-1)
        self.worker, self.pending_scale = self.ef.worker_form(device)
        self.x_prime = self.into.next_x_prime_buffer(self.ef, self.numel, self.n, device)
        if self.x_prime is None and (self.addend is not None or self.divisor != 1.0):
            raise ValueError("a formed tensor needs a scan that writes x' (see CallSpec.formed)")
        self.started = True

    def chunk(self, j: int) -> None:
        """Scan chunk j into row j (every chunk, at the first call, for a tensor scanned whole)."""
        if self.failure is not None or (self.whole and self.started):
            return
        try:
            self._start()
            if self.whole:
                self.sums[0] = self._scan(0, self.n * self.size, self.numel, self.rows.view(-1))
            else:
                start = j * self.size
                self.sums[j] = self._scan(start, start + self.size, real_count(j, self.numel, self.n), self.rows[j])
        except Exception as exc:
            self.failure = exc

    def _scan(self, start: int, stop: int, real: int, bits: torch.Tensor) -> float:
        """Elements [start, stop) of the padded tensor, `real` of them real, into `bits`: their
        sum of squares."""
        return codec.codec_for(self.tensor.device).worker_scan(
            self.flat[start : start + real],
            None if self.worker is None else self.worker[start:stop],
            bits,
            self.pending_scale,
            None if self.x_prime is None else self.x_prime[start:stop],
            None if self.addend is None else self.addend[start : start + real],
            self.divisor,
        )

    def result(self) -> Scanned:
        """(flat view, rows, s_r, new x') once every chunk is scanned; raises a chunk's failure."""
        if self.failure is not None:
            raise self.failure
        total = 0.0
        for part in self.sums:  # plain left-to-right adds (sum() of floats compensates from Python 3.12)
            total += part
        return self.flat, self.rows, codec.rms_scale(total, self.numel), self.x_prime


def _exact_rows(tensor: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """For an exact call: the flattened tensor, its fp32 chunks as bytes (n, 4C) and max |x|,
    which bounds the sums as s_r does (NaN/inf when x is not finite)."""
    numel = tensor.numel()
    flat = tensor.detach().reshape(-1)
    rows = torch.zeros(n, chunk_size(numel, n), dtype=torch.float32, device=tensor.device)
    rows.view(-1)[:numel].copy_(flat)
    return flat, rows.view(torch.uint8), largest_magnitude(flat)


@dataclass
class FlatCall:
    """One tensor of a call accepted by phase 0 on every rank: all that phases 1 and 2 need."""

    spec: CallSpec
    index: int  # the tensor's place in the call
    be: Backend
    agreement: Agreement
    flat: torch.Tensor  # the tensor's flat view, or a contiguous copy
    rows: torch.Tensor  # (n, W) bytes of phase 1, row j for server j: packed signs, or fp32 if exact
    scale: float  # this rank's s_r (max |x| if exact)
    exact: bool
    x_prime: torch.Tensor | None  # x' = x + e_w from the scan: the worker error state after the call
    result: torch.Tensor | None = None  # after commit: phase 2's bytes, see `decode_result`
    sent: bool = False  # phase 1 already ran during the scan: `rows` are the rows received
    output: torch.Tensor | None = None  # where the result is decoded, flat (`CallSpec.outputs`)

    @property
    def tensor(self) -> torch.Tensor:
        return self.spec.tensors[self.index].detach()

    @property
    def decoded_into(self) -> torch.Tensor:
        return self.flat if self.output is None else self.output

    def commit(self) -> torch.Tensor:
        """Phases 1 and 2 and the decode; writes the errors after the call; returns the tensor."""
        with torch.no_grad():
            return self.be.ordered(self._commit)

    def _commit(self) -> torch.Tensor:
        """Each error update runs while the collective that does not depend on it is in flight."""
        if self.exact:
            self.result = self._gather(self._exact_sum(self._phase1(lambda: None)), lambda: None)
            into, ef = self.spec.into(self.index), self.spec.error_feedbacks[self.index]
            if into is not ef:
                into.copy_(ef)  # the errors after the call are those before it
        else:
            self.result = self._one_bit()
        tensor = self.tensor
        if self.exact:  # a 1-bit result was decoded chunk by chunk during phase 2
            decode_result(self.result, self.decoded_into, exact=True)
        if self.output is None and (self.flat.data_ptr() != tensor.data_ptr() or not tensor.is_contiguous()):
            tensor.copy_(self.flat.view(tensor.shape))
        return tensor

    def _one_bit(self) -> torch.Tensor:
        be, flat, numel = self.be, self.flat, self.flat.numel()
        n, device = be.world_size, flat.device
        into, source = self.spec.into(self.index), self.spec.error_feedbacks[self.index]
        coder = codec.codec_for(device)
        if self.x_prime is not None:  # the scan wrote the worker error's new state
            server, previous = into.take_x_prime(source, self.x_prime, self.scale, numel, n)
            into.rank = self.spec.owner_over(be)
            received = self._phase1(lambda: None)
        else:
            worker, maybe_server, worker_out = into.follow(source, numel, n, device)
            into.rank = self.spec.owner_over(be)
            assert maybe_server is not None  # an allreduce's errors have a server side
            server = previous = maybe_server

            def worker_update() -> None:
                coder.error_update_(worker, self.scale, numel, flat, worker_out)

            received = self._phase1(worker_update)
        served = real_count(be.rank, numel, n)
        mine = torch.empty(SERVER_SCALE_BYTES + received.shape[1], dtype=torch.uint8, device=device)
        divisor = n if self.spec.op == "mean" else 1
        scales = torch.from_numpy(self.agreement.bounds(self.index)).to(device)
        sum_sq = coder.server_scan_(received, scales, divisor, server, served, mine[SERVER_SCALE_BYTES:], previous)
        server_scale = codec.rms_scale(sum_sq, served)
        mine[:SERVER_SCALE_BYTES].copy_(torch.tensor([server_scale], dtype=torch.float32).view(torch.uint8))

        def server_update_and_own_chunk() -> None:
            into.record_server_max(coder.error_update_(server, server_scale, served, measure=True))
            decode_chunk(mine, server_scale, self.decoded_into, be.rank, n)  # before its bytes return

        def peer_chunk(message: torch.Tensor, j: int) -> None:
            decode_chunk(message, message_scale(message), self.decoded_into, j, n)

        return self._gather(mine, server_update_and_own_chunk, peer_chunk)

    def _phase1(self, meanwhile: Callable[[], None]) -> torch.Tensor:
        """(n, W): row r is what rank r sent this one, while `meanwhile()` runs."""
        if self.sent:
            meanwhile()
            return self.rows
        early = self.agreement.early if self.index == 0 else None
        received = exchange_rows(self.be, self.rows, early, meanwhile)
        self.rows = received  # drop what was sent
        return received

    def _exact_sum(self, received: torch.Tensor) -> torch.Tensor:
        """This server's chunk of the exact reduction, as bytes."""
        return exact_sum(received, self.be.world_size if self.spec.op == "mean" else 1).view(torch.uint8)

    def _gather(
        self,
        mine: torch.Tensor,
        meanwhile: Callable[[], None],
        arrived: Callable[[torch.Tensor, int], None] | None = None,
    ) -> torch.Tensor:
        """Phase 2: every server's message, (n, len(mine)), while `meanwhile()` runs and, as
        each other server j's message comes in, `arrived(message, j)` (the transport may deliver
        them one by one: their decode then overlaps the messages still on the wire)."""
        everyone = torch.empty(self.be.world_size, mine.numel(), dtype=torch.uint8, device=mine.device)
        self.be.all_gather_arriving(
            mine, everyone, meanwhile, (lambda j: arrived(everyone[j], j)) if arrived else (lambda j: None)
        )
        return everyone


def exact_sum(received: torch.Tensor, divisor: int) -> torch.Tensor:
    """The exact reduction of fp32 rows ((n, 4C) bytes): summed in rank order, then / divisor."""
    parts = as_fp32(received)
    return codec.divide_(sum_in_rank_order(list(parts), torch.empty_like(parts[0])), divisor)


def decode_result(everyone: torch.Tensor, out: torch.Tensor, exact: bool = False) -> None:
    """out (the N-element flat output, any float dtype) <- the call's result, from phase 2's bytes:
    row j holds server j's t_j (fp32) and the packed signs of its chunk, or if `exact` its fp32 sums."""
    n, numel = everyone.shape[0], out.numel()
    if exact:
        out.copy_(as_fp32(everyone).view(-1)[:numel])
        return
    # copied out: the rows need not be aligned for fp32 (one row at an odd offset, when a single
    # node decodes its part from the node's gathered results)
    server_scales = everyone[:, :SERVER_SCALE_BYTES].reshape(-1).clone().view(torch.float32).tolist()
    for j in range(n):
        decode_chunk(everyone[j], server_scales[j], out, j, n)


def message_scale(message: torch.Tensor) -> float:
    """t_j, from the first bytes of server j's phase-2 message (copied out: the row need not be
    aligned for fp32)."""
    return float(message[:SERVER_SCALE_BYTES].clone().view(torch.float32))


def decode_chunk(message: torch.Tensor, scale: float, out: torch.Tensor, j: int, n: int) -> None:
    """Chunk j of the N-element flat output `out` <- t_j sign(y_j), from server j's phase-2
    message (its scale's bytes, then the packed signs); `scale` is t_j, read from them."""
    numel = out.numel()
    k = real_count(j, numel, n)
    if k:
        start = j * chunk_size(numel, n)
        codec.codec_for(out.device).decode(message[SERVER_SCALE_BYTES:], scale, out[start : start + k])


def result_bytes(numel: int, n: int, exact: bool) -> int:
    """Bytes of phase 2's result of a `numel`-element call over n ranks (all servers' messages)."""
    return n * 4 * chunk_size(numel, n) if exact else n * (SERVER_SCALE_BYTES + chunk_size(numel, n) // 8)


def as_fp32(rows: torch.Tensor) -> torch.Tensor:
    """(n, 4C) contiguous bytes as (n, C) fp32, also when C = 0 (an empty part)."""
    return rows.reshape(-1).view(torch.float32).view(rows.shape[0], rows.shape[1] // 4)

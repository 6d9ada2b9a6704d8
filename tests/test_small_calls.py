"""Small calls on 4 real gloo ranks: phase 0's all-to-all (equal-sized on every rank) carries the first bytes of
phase 1 (so a call whose signs fit makes two collectives, and sizes that differ across ranks are
still an error, never a hang), and `min_compress_bytes`, which reduces small tensors exactly
(fp32 sums in rank order) with the same checks and the error feedback left alone."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

import compcomm
from compcomm.agreement import FOLD_BYTES, HEADER
from compcomm.backends.torch_dist import DIRECT_GATHER_BYTES
from compcomm.layout import chunk_size
from compcomm.schedules.flat import SERVER_SCALE_BYTES

from rankpool import caught, group

WORLD = 4


def _backend():
    return compcomm.backends.get("gloo", group=group(WORLD))


def _input(rank: int, numel: int, dtype: torch.dtype, step: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return (torch.randn(numel, generator=g) * (rank + 1)).to(dtype)


def exact_calls(numel: int, dtype: torch.dtype, op: str) -> dict:
    be = _backend()
    ef = compcomm.ErrorFeedback()
    x = _input(be.rank, numel, dtype)
    t, threshold = x.clone(), numel * x.element_size() + 1
    compcomm.compressed_allreduce(x.clone(), compcomm.ErrorFeedback(), backend=be, op=op, min_compress_bytes=threshold)
    before = be.bytes_sent  # a repeated call: phase 0 has room for what the previous one needed
    compcomm.compressed_allreduce(t, ef, backend=be, op=op, min_compress_bytes=threshold)
    return {
        "input": x.float().numpy(),
        "output": t.float().numpy(),
        "raw": t.view(-1).numpy().tobytes() if dtype == torch.float32 else t.view(torch.int16).numpy().tobytes(),
        "errors": (ef.worker_error, ef.server_error),
        "bytes": be.bytes_sent - before,
    }


@pytest.mark.parametrize("numel", [1, 1000, 100_000])  # the last one's fp32 rows exceed phase 0's room
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("op", ["mean", "sum"])
def test_below_min_compress_bytes_is_the_rank_order_sum(pool, numel, dtype, op):
    records = pool.run(exact_calls, numel, dtype, op)
    assert len({rec["raw"] for rec in records}) == 1, "outputs differ between ranks"
    total = torch.from_numpy(records[0]["input"]).clone()
    for rec in records[1:]:
        total += torch.from_numpy(rec["input"])
    if op == "mean":
        total /= WORLD
    expected = total.to(dtype).float().numpy()
    np.testing.assert_array_equal(records[0]["output"], expected)
    assert all(rec["errors"] == (None, None) for rec in records), "the error feedback was touched"
    c = chunk_size(numel, WORLD)
    assert records[0]["bytes"] == (WORLD - 1) * (HEADER.itemsize + 2 * 4 * c)


def _counted(be) -> dict:
    """Count the byte collectives `be` starts (the transport itself is untouched)."""
    counts = {"all_to_all": 0, "all_gather": 0}
    for name in counts:
        start = getattr(be, "_" + name)

        def counting(*args, _start=start, _name=name):
            counts[_name] += 1
            return _start(*args)

        setattr(be, "_" + name, counting)
    return counts


def repeated_call(previous: int, numel: int) -> dict:
    """A call of `previous` elements, then one of `numel`: the second one's bytes and collectives."""
    be = _backend()
    compcomm.compressed_allreduce(_input(be.rank, previous, torch.float32), compcomm.ErrorFeedback(), backend=be)
    counts = _counted(be)
    before = be.bytes_sent
    compcomm.compressed_allreduce(_input(be.rank, numel, torch.float32), compcomm.ErrorFeedback(), backend=be)
    return {"bytes": be.bytes_sent - before, **counts}


@pytest.mark.parametrize(
    "previous,numel", [(1000, 1000), (1 << 18, 1 << 18), (3 << 20, 3 << 20), (3 << 20, 1000), (1000, 3 << 20)]
)
def test_phase_zero_carries_as_much_of_phase_one_as_the_previous_call_needed(pool, previous, numel):
    """The room in phase 0's slots is the previous accepted call's row width (at most
    FOLD_BYTES / n): a repeated call whose signs fit makes two collectives, a large one sends
    the rest in phase 1, and padding never exceeds what the previous call's rows needed."""
    sent = pool.run(repeated_call, previous, numel)
    assert len({tuple(r.items()) for r in sent}) == 1
    c8, before = chunk_size(numel, WORLD) // 8, chunk_size(previous, WORLD) // 8
    room = min(FOLD_BYTES // WORLD, before)
    assert sent[0]["bytes"] == (WORLD - 1) * (HEADER.itemsize + room + max(0, c8 - room) + SERVER_SCALE_BYTES + c8)
    assert sent[0]["all_to_all"] == (1 if c8 <= room else 2)
    if previous == numel:  # steady state: the signs once, plus 20 bytes per peer
        assert sent[0]["bytes"] == (WORLD - 1) * (2 * c8 + HEADER.itemsize + SERVER_SCALE_BYTES)
        assert sent[0]["all_to_all"] == 1 + (c8 > FOLD_BYTES // WORLD)
    assert sent[0]["all_gather"] == 1


def rejected(
    numel_of_rank: dict,
    threshold_of_rank: dict,
    poison: int | None = None,
    dtype: torch.dtype = torch.float32,
    magnitude: float = 1.0,
    op: str = "mean",
    numel: int = 64,
    failing_scan: int | None = None,
) -> dict:
    """A call of `numel` elements (other sizes on the ranks of `numel_of_rank`) after one like
    it, rejected on every rank: what each rank caught, and whether it kept its tensor and errors.
    Rank `failing_scan`'s worker scan raises at its second chunk."""
    be = _backend()
    ef = compcomm.ErrorFeedback()
    compcomm.compressed_allreduce(_input(be.rank, numel, torch.float32), ef, backend=be)  # a state to keep
    state = {k: v.clone() for k, v in ef.state_dict().items() if isinstance(v, torch.Tensor)}
    x = _input(be.rank, numel_of_rank.get(be.rank, numel), torch.float32)
    x = (x / x.abs().max() * magnitude).to(dtype)
    if poison == be.rank:
        x[0] = float("nan")
    t = x.clone()
    scan = compcomm.codec.Codec.worker_scan
    scanned = []

    def failing(*args, **kwargs):
        scanned.append(1)
        if len(scanned) == 2:
            raise RuntimeError("the scan failed")
        return scan(*args, **kwargs)

    if failing_scan == be.rank:
        compcomm.codec.Codec.worker_scan = failing
    try:
        result = caught(
            compcomm.compressed_allreduce,
            t,
            ef,
            backend=be,
            op=op,
            min_compress_bytes=threshold_of_rank.get(be.rank, 1 << 20),
        )
    finally:
        compcomm.codec.Codec.worker_scan = scan
    kept = (
        all(torch.equal(v, ef.state_dict()[k]) for k, v in state.items()) and t.numpy().tobytes() == x.numpy().tobytes()
    )  # bitwise: NaN stays where it was
    after = caught(compcomm.compressed_allreduce, torch.ones(64), compcomm.ErrorFeedback(), backend=be)
    return {"caught": result, "kept": kept, "after": after}


BAD_CALLS = {
    "threshold_differs": ({}, {2: 0}),
    "threshold_invalid": ({}, {1: -5}),
    "threshold_float": ({}, {1: 96.0}),  # said "a number of bytes >= 0, got 96.0" (from a probe)
    "nan": ({}, {}, 3),
    "overflow": ({}, {}, None, torch.float16, 3e4, "sum"),  # each rank's values fit fp16, the sum not
    "numel_differs": ({0: 5_000_000}, {}),
    # after a wide call, phase 0 comes in two halves around a phase 1 sent during the scan
    "streamed_numel_differs": ({0: 5_000_008}, {}, None, torch.float32, 1.0, "mean", 5_000_000),
    "streamed_threshold_differs": ({}, {2: 1 << 30}, None, torch.float32, 1.0, "mean", 5_000_000),
    "streamed_nan": ({}, {}, 3, torch.float32, 1.0, "mean", 5_000_000),
    "streamed_scan_fails": ({}, {}, None, torch.float32, 1.0, "mean", 5_000_000, 2),
}


@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_bad_calls_raise_everywhere_and_change_nothing(pool, case):
    records = pool.run(rejected, *BAD_CALLS[case])
    assert all(rec["kept"] for rec in records), "a rejected call changed a tensor or error state"
    errors = {rec["caught"] for rec in records}
    assert len(errors) == 1 and None not in errors, f"ranks disagree: {errors}"
    cls, message = errors.pop()
    expected = {
        "threshold_differs": ("ValueError", "min_compress_bytes"),
        "threshold_invalid": ("ValueError", "min_compress_bytes must be"),
        "threshold_float": ("ValueError", "an integer number of bytes >= 0, got float 96.0"),
        "nan": ("NonFiniteError", "non-finite"),
        "overflow": ("NonFiniteError", "overflow"),
        "numel_differs": ("ValueError", "not 5000000 elements"),
        "streamed_numel_differs": ("ValueError", "rank 0"),
        "streamed_threshold_differs": ("ValueError", "min_compress_bytes"),
        "streamed_nan": ("NonFiniteError", "non-finite"),
        "streamed_scan_fails": ("RuntimeError", "rank 2: the scan failed"),
    }[case]
    assert cls == expected[0] and expected[1] in message, message
    assert all(rec["after"] is None for rec in records), "the group does not work after the rejected call"


def empty_exact() -> dict:
    be = _backend()
    t = torch.zeros(0, dtype=torch.float16)
    error = caught(compcomm.compressed_allreduce, t, compcomm.ErrorFeedback(), backend=be, min_compress_bytes=8)
    return {"error": error, "numel": t.numel()}


def test_empty_tensor_below_min_compress_bytes(pool):
    """Regression: an empty tensor always goes exact, and its (n, 0) result failed to decode
    after phase 0 had accepted the call (a RuntimeError on every rank)."""
    assert pool.run(empty_exact) == [{"error": None, "numel": 0}] * WORLD
    t = torch.zeros(0)
    assert compcomm.compressed_allreduce(t, compcomm.ErrorFeedback(), backend="local", min_compress_bytes=1) is t
    x = torch.ones(3)  # any integer type is a number of bytes (numpy's too)
    compcomm.compressed_allreduce(x, compcomm.ErrorFeedback(), backend="local", min_compress_bytes=np.int64(64))
    assert torch.equal(x, torch.ones(3))


def coalesced_pairing(rank_with_extra_tensor: int) -> dict:
    be = _backend()
    tensors = [_input(be.rank, 10, torch.float32)]
    if be.rank == rank_with_extra_tensor:
        tensors.append(_input(be.rank, 10, torch.float32))
    error = caught(compcomm.compressed_allreduce_coalesced, tensors, [compcomm.ErrorFeedback()], backend=be)
    after = caught(
        compcomm.compressed_allreduce_coalesced,
        [_input(be.rank, 10, torch.float32)],
        [compcomm.ErrorFeedback()],
        backend=be,
    )
    return {"error": error, "after": after}


def test_a_bad_pairing_on_one_rank_is_an_error_everywhere(pool):
    """Regression: two tensors and one ErrorFeedback on one rank raised there before phase 0,
    and the other ranks waited for it forever."""
    results = pool.run(coalesced_pairing, 2)
    assert len({r["error"] for r in results}) == 1, results
    cls, message = results[0]["error"]
    assert cls == "ValueError" and "rank 2" in message and "one ErrorFeedback per tensor" in message
    assert all(r["after"] is None for r in results)


class _Spy:
    """A transport that counts the calls of its two gather primitives and forwards everything."""

    def __init__(self, inner) -> None:
        self.inner, self.calls = inner, {"alltoall_base": 0, "_allgather_base": 0}

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if name not in self.calls:
            return attr

        def counted(*args):
            self.calls[name] += 1
            return attr(*args)

        return counted


def gathered(numel: int) -> dict:
    """A gloo all_gather of `numel` bytes per rank: its rows, bytes counted, and which of
    gloo's primitives moved it."""
    be = _backend()
    channel = be.channel
    spy = channel.transport = _Spy(channel.transport)
    try:
        before = be.bytes_sent
        everyone = torch.empty(WORLD, numel, dtype=torch.uint8)
        be.all_gather(torch.full((numel,), be.rank + 1, dtype=torch.uint8), everyone)
    finally:
        channel.transport = spy.inner
    rows = [sorted(set(row.tolist())) for row in everyone]
    return {"rows": rows, "bytes": be.bytes_sent - before, **spy.calls}


def arriving(numel: int) -> dict:
    """all_gather_arriving of `numel` bytes per rank inside a call: each row handed over once,
    filled when it is, `meanwhile` run once, and which of gloo's primitives moved it; and
    the error it raises outside a call."""
    be = _backend()
    everyone = torch.zeros(WORLD, numel, dtype=torch.uint8)
    order, complete, meanwhile = [], [], []

    def arrived(j: int) -> None:
        order.append(j)
        complete.append(bool((everyone[j] == j + 1).all()))

    def gather() -> dict:
        channel = be.channel
        spy = channel.transport = _Spy(channel.transport)
        spy.calls.update(send=0)
        try:
            be.all_gather_arriving(
                torch.full((numel,), be.rank + 1, dtype=torch.uint8), everyone, lambda: meanwhile.append(1), arrived
            )
        finally:
            channel.transport = spy.inner
        return spy.calls

    before = be.bytes_sent
    calls = be.ordered(gather)
    sent = be.bytes_sent - before
    outside = caught(
        lambda: be.all_gather_arriving(
            torch.zeros(1, dtype=torch.uint8), torch.zeros(WORLD, 1, dtype=torch.uint8), list, list
        )
    )
    rows = [sorted(set(row.tolist())) for row in everyone]
    return {
        "rank": be.rank,
        "order": order,
        "complete": complete,
        "meanwhile": len(meanwhile),
        "rows": rows,
        "bytes": sent,
        "calls": calls,
        "outside": outside,
    }


@pytest.mark.parametrize("numel", [4096, DIRECT_GATHER_BYTES + 1])
def test_rows_are_handed_over_as_they_arrive(pool, numel):
    """Beyond DIRECT_GATHER_BYTES, gloo's all-gather with per-row arrival is a ring of
    point-to-point steps: the left neighbour's row first, then the one before it, each complete
    when handed over; below, one collective and every row at its end. The same rows and bytes."""
    for rec in pool.run(arriving, numel):
        me = rec["rank"]
        assert rec["rows"] == [[r + 1] for r in range(WORLD)]
        assert rec["bytes"] == (WORLD - 1) * numel and rec["meanwhile"] == 1
        assert all(rec["complete"]) and sorted(rec["order"]) == [r for r in range(WORLD) if r != me]
        if numel > DIRECT_GATHER_BYTES:
            assert rec["order"] == [(me - 1 - s) % WORLD for s in range(WORLD - 1)]
            assert rec["calls"] == {"alltoall_base": 0, "_allgather_base": 0, "send": WORLD - 1}
        else:
            assert rec["calls"] == {"alltoall_base": 1, "_allgather_base": 0, "send": 0}
        assert rec["outside"] is not None and "inside a compcomm call" in rec["outside"][1]


@pytest.mark.parametrize("numel", [1, 4096, DIRECT_GATHER_BYTES, DIRECT_GATHER_BYTES + 1, 1 << 20])
def test_small_all_gather_goes_straight_to_every_rank(pool, numel):
    """gloo's all-gather is a ring of n - 1 steps; up to DIRECT_GATHER_BYTES it goes as one
    all-to-all of n copies instead (phase 2 of a call of up to 4 MiB of fp32 on 4 ranks), with
    the same result and the same bytes counted."""
    for rec in pool.run(gathered, numel):
        assert rec["rows"] == [[r + 1] for r in range(WORLD)]
        assert rec["bytes"] == (WORLD - 1) * numel
        direct = numel <= DIRECT_GATHER_BYTES
        assert (rec["alltoall_base"], rec["_allgather_base"]) == ((1, 0) if direct else (0, 1))


def produced(numel: int, failing: int | None = None) -> dict:
    """all_to_all_as_produced of `numel`-byte rows inside a call (row j of rank r filled with
    10 r + j + 1 when produced; rank `failing` raises instead of producing its first row): the
    order rows were asked for, when `meanwhile` ran, what arrived, the bytes and primitives,
    the error raised, and whether the group still works after it."""
    be = _backend()
    send = torch.zeros(WORLD, numel, dtype=torch.uint8)
    recv = torch.zeros(WORLD, numel, dtype=torch.uint8)
    order: list[int] = []
    meanwhile: list[int] = []

    def produce(j: int) -> None:
        order.append(j)
        if be.rank == failing and len(order) == 1:
            raise RuntimeError("produce failed")
        send[j].fill_(10 * be.rank + j + 1)

    def exchange() -> dict:
        channel = be.channel
        spy = channel.transport = _Spy(channel.transport)
        spy.calls.update(send=0)
        try:
            error = caught(be.all_to_all_as_produced, send, recv, produce, lambda: meanwhile.append(len(order)))
        finally:
            channel.transport = spy.inner
        return {"error": error, "calls": spy.calls}

    before = be.bytes_sent
    outcome = be.ordered(exchange)
    sent = be.bytes_sent - before
    after = torch.empty(WORLD, 1, dtype=torch.uint8)
    be.all_gather(torch.tensor([be.rank], dtype=torch.uint8), after)
    outside = caught(be.all_to_all_as_produced, send, recv, list, list)
    return {
        "rank": be.rank,
        "order": order,
        "meanwhile": meanwhile,
        "rows": [sorted(set(row.tolist())) for row in recv],
        "bytes": sent,
        "error": outcome["error"],
        "calls": outcome["calls"],
        "after": after.view(-1).tolist(),
        "outside": outside,
    }


@pytest.mark.parametrize("numel", [4096, DIRECT_GATHER_BYTES + 1])
@pytest.mark.parametrize("failing", [None, 2])
def test_rows_are_produced_as_the_transport_sends_them(pool, numel, failing):
    """Beyond DIRECT_GATHER_BYTES per row, gloo asks for rank r's rows in the order r + 1, r + 2,
    ... (its own last) and sends each as soon as it is produced; below, every row is produced
    and one all-to-all sends them. `meanwhile` runs once, after the last row. A rank whose
    `produce` raises still sends and receives every row (the one it did not write as it was),
    then raises alone, and the group goes on working."""
    for rec in pool.run(produced, numel, failing):
        me = rec["rank"]
        streams = numel > DIRECT_GATHER_BYTES
        assert rec["order"] == ([(me + k) % WORLD for k in range(1, WORLD)] + [me] if streams else list(range(WORLD)))
        assert rec["meanwhile"] == [WORLD] and rec["bytes"] == (WORLD - 1) * numel
        sends = {"alltoall_base": 0, "_allgather_base": 0, "send": WORLD - 1}
        assert rec["calls"] == (sends if streams else {"alltoall_base": 1, "_allgather_base": 0, "send": 0})
        unwritten = failing is not None and me == ((failing + 1) % WORLD if streams else 0)  # failing's first row
        assert rec["rows"] == [[0] if unwritten and r == failing else [10 * r + me + 1] for r in range(WORLD)]
        assert rec["error"] == (("RuntimeError", "produce failed") if me == failing else None)
        assert rec["after"] == list(range(WORLD))
        assert rec["outside"] is not None and "inside a compcomm call" in rec["outside"][1]


STREAMED = 5_000_000
"""A call whose sign rows (on 4 ranks) exceed DIRECT_GATHER_BYTES: after one like it, gloo
streams phase 1 with the scan."""


def streamed_call(steps: int) -> dict:
    """`steps` calls of STREAMED elements; per call whether it streamed, and the point-to-point
    sends and collectives it made; the errors, and the output (rank 0's; the others' digest),
    for the reference (the test makes the inputs itself, as `_input` does here)."""
    from compcomm.agreement import previous_row_width

    be = _backend()
    ef = compcomm.ErrorFeedback()
    records = []
    for step in range(steps):
        x = _input(be.rank, STREAMED, torch.float32, step)
        t = x.clone()
        streams = be.sends_row_by_row(previous_row_width(be))
        channel = be.channel
        spy = channel.transport = _Spy(channel.transport)
        spy.calls.update(send=0)
        try:
            compcomm.compressed_allreduce(t, ef, backend=be)
        finally:
            channel.transport = spy.inner
        records.append(
            {
                "streams": streams,
                "calls": dict(spy.calls),
                "digest": hashlib.sha256(t.numpy().tobytes()).hexdigest(),
                "output": t.numpy() if be.rank == 0 else None,
                "worker": ef.worker_error.clone().numpy(),
                "server": ef.server_error.clone().numpy(),
            }
        )
    compcomm.compressed_allreduce(torch.ones(64), compcomm.ErrorFeedback(), backend=be)  # leave the memory narrow
    return records


def test_phase_one_streams_with_the_scan_after_a_wide_call(pool):
    """After a call whose rows exceed DIRECT_GATHER_BYTES, gloo sends each chunk's signs to its
    server as soon as they are scanned (n - 1 sends) and agrees in two small all-gathers; the
    results and errors are the float64 reference's, step by step, and equal on every rank."""
    from compcomm.layout import padded_size

    from reference import assert_close, reference_allreduce

    steps = 3
    per_rank = pool.run(streamed_call, steps)
    m = padded_size(STREAMED, WORLD)
    worker, server = np.zeros((WORLD, m)), np.zeros((WORLD, m // WORLD))
    for step in range(steps):
        records = [per_rank[r][step] for r in range(WORLD)]
        assert [rec["streams"] for rec in records] == [step > 0] * WORLD
        ring = WORLD - 1  # phase 2's point-to-point steps
        for rec in records:
            if step:  # phase 0a and 0b: all-gathers of headers; phase 1: sends; phase 2: the ring
                assert rec["calls"] == {"alltoall_base": 2, "_allgather_base": 0, "send": 2 * (WORLD - 1)}
            else:  # phase 0 folded into one all-to-all, phase 1 another, phase 2 the ring
                assert rec["calls"] == {"alltoall_base": 2, "_allgather_base": 0, "send": ring}
        assert len({rec["digest"] for rec in records}) == 1, "outputs differ between ranks"
        inputs = [_input(r, STREAMED, torch.float32, step).double().numpy() for r in range(WORLD)]
        expected, worker, server = reference_allreduce(inputs, worker, server)
        assert_close(records[0]["output"], expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
        got_worker = np.stack([rec["worker"] for rec in records]).astype(np.float64)
        got_server = np.stack([rec["server"] for rec in records]).astype(np.float64)
        assert_close(got_worker, worker, rtol=1e-5, atol=1e-5 * np.abs(worker).max())
        assert_close(got_server, server, rtol=1e-5, atol=1e-5 * np.abs(server).max())
        worker, server = got_worker, got_server

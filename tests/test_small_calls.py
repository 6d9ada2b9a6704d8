"""Small calls on 4 real gloo ranks: phase 0's all-to-all (equal-sized on every rank) carries the first bytes of
phase 1 (so a call whose signs fit makes two collectives, and sizes that differ across ranks are
still an error, never a hang), and `min_compress_bytes`, which reduces small tensors exactly
(fp32 sums in rank order) with the same checks and the error feedback left alone."""

from __future__ import annotations

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
) -> dict:
    be = _backend()
    ef = compcomm.ErrorFeedback()
    compcomm.compressed_allreduce(_input(be.rank, 64, torch.float32), ef, backend=be)  # a state to keep
    state = {k: v.clone() for k, v in ef.state_dict().items() if isinstance(v, torch.Tensor)}
    x = _input(be.rank, numel_of_rank.get(be.rank, 64), torch.float32)
    x = (x / x.abs().max() * magnitude).to(dtype)
    if poison == be.rank:
        x[0] = float("nan")
    t = x.clone()
    result = caught(
        compcomm.compressed_allreduce,
        t,
        ef,
        backend=be,
        op=op,
        min_compress_bytes=threshold_of_rank.get(be.rank, 1 << 20),
    )
    kept = (
        all(torch.equal(v, ef.state_dict()[k]) for k, v in state.items()) and t.numpy().tobytes() == x.numpy().tobytes()
    )  # bitwise: NaN stays where it was
    return {"caught": result, "kept": kept}


@pytest.mark.parametrize("case", ["threshold_differs", "threshold_invalid", "nan", "overflow", "numel_differs"])
def test_bad_calls_raise_everywhere_and_change_nothing(pool, case):
    args = {
        "threshold_differs": ({}, {2: 0}),
        "threshold_invalid": ({}, {1: -5}),
        "nan": ({}, {}, 3),
        "overflow": ({}, {}, None, torch.float16, 3e4, "sum"),  # each rank's values fit fp16, the sum not
        "numel_differs": ({0: 5_000_000}, {}),
    }[case]
    records = pool.run(rejected, *args)
    assert all(rec["kept"] for rec in records), "a rejected call changed a tensor or error state"
    errors = {rec["caught"] for rec in records}
    assert len(errors) == 1 and None not in errors, f"ranks disagree: {errors}"
    cls, message = errors.pop()
    expected = {
        "threshold_differs": ("ValueError", "min_compress_bytes"),
        "threshold_invalid": ("ValueError", "min_compress_bytes must be"),
        "nan": ("NonFiniteError", "non-finite"),
        "overflow": ("NonFiniteError", "overflow"),
        "numel_differs": ("ValueError", "not 5000000 elements"),
    }[case]
    assert cls == expected[0] and expected[1] in message, message


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

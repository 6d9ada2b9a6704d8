"""The shared-memory backend on real spawned ranks of one host: every collective bitwise equal to
gloo's over the same group (2, 3 and 4 ranks, uneven and empty sizes, the segment grown again
and again), the same bytes_sent, async calls ordered against the caller's own collectives, a
peer that never arrives or dies raising RuntimeError within the timeout, and nothing left in
/dev/shm."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

import compcomm
from compcomm import backends
from compcomm.backends.rank_order import sum_in_rank_order
from compcomm.backends.shm_segment import PREFIX, SHM_DIRECTORY
from compcomm.launch import rank_environment

from rankpool import caught, group, reports_of_dying_ranks

GROUPS = [(0, 1), (0, 1, 2), (0, 1, 2, 3), (1, 3)]
ABSENT_GROUP = (2, 3)  # only test_a_peer_that_never_arrives uses these two: they leave
ABSENT_RENDEZVOUS_GROUP = (0, 2)  # their groups out of step
_made: dict[tuple[int, ...], tuple[object, object]] = {}  # per rank process: members -> (shm, gloo)


def pair(members: tuple[int, ...]) -> tuple:
    """This rank's (shm, gloo) backends over `members`, made once per rank process."""
    if members not in _made:
        _made[members] = (backends.get("shm", group=group(members)), backends.get("gloo", group=group(members)))
    return _made[members]


def random_bytes(seed: int, *shape: int) -> torch.Tensor:
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def byte_collectives(members: tuple[int, ...], sizes: list[int]) -> dict:
    import torch.distributed as dist

    shm, gloo = pair(members)
    n, me = shm.world_size, dist.get_rank()
    made_before = shm.transport.made
    outcome: dict = {"same": [], "sent": None}
    for size in sizes:
        send, blocks = random_bytes(me * 7919 + size, size), random_bytes(me * 31 + size, n, size)
        for name, call, args in (("all_gather", "all_gather", (send,)), ("all_to_all", "all_to_all", (blocks,))):
            got = [torch.full((n, size), 7, dtype=torch.uint8) for _ in range(2)]
            for be, recv in zip((shm, gloo), got):
                getattr(be, call)(*args, recv)
            outcome["same"].append((name, size, torch.equal(got[0], got[1])))
    outcome["sent"] = (shm.bytes_sent, gloo.bytes_sent)
    outcome["segments_made"] = shm.transport.made - made_before
    return outcome


@pytest.mark.parametrize("members", GROUPS)
def test_all_gather_and_all_to_all_equal_gloo_as_the_segment_grows(pool, members):
    sizes = [0, 1, 7, 4097, 70_001, 300_007, 5, 1 << 20]  # growth after growth, then small again
    results = pool.run(byte_collectives, members, sizes, ranks=members)
    for r in results:
        assert all(same for _, _, same in r["same"]), [c for c in r["same"] if not c[2]]
        assert r["sent"][0] == r["sent"][1]  # the same bytes_sent as gloo for the same calls
        assert r["segments_made"] >= 3
    assert len({r["segments_made"] for r in results}) == 1


def reduce_inputs(members: tuple[int, ...], numel: int, dtype: torch.dtype, exact: bool) -> list[torch.Tensor]:
    """Every member's input (each rank makes all of them, for a reference); with `exact`, small
    integers, whose sums do not depend on the order of the additions."""
    out = []
    for r in members:
        g = torch.Generator().manual_seed(1000 * r + numel)
        x = torch.randint(-8, 9, (numel,), generator=g).float() if exact else torch.randn(numel, generator=g) * 3
        out.append(x.to(dtype))
    return out


def all_reduce(members: tuple[int, ...], numels: list[int], dtype: torch.dtype, op: str, exact: bool) -> list:
    import torch.distributed as dist

    shm, gloo = pair(members)
    me = members.index(dist.get_rank())
    rows = []
    for numel in numels:
        inputs = reduce_inputs(members, numel, dtype, exact)
        a, b = inputs[me].clone(), inputs[me].clone()
        shm.all_reduce(a, op)
        gloo.all_reduce(b, op)
        ordered = inputs[0].clone()  # the documented order: ((x0 + x1) + x2) + ..., in the dtype
        for x in inputs[1:]:
            ordered += x
        if op == "mean":
            ordered /= len(members)
        rows.append((numel, a.view(torch.uint8).numpy().tobytes(), torch.equal(a, b), torch.equal(a, ordered)))
    return rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("op", ["sum", "mean"])
@pytest.mark.parametrize("members, exact", [((0, 1), False), ((0, 1, 2), True), ((0, 1, 2, 3), True)])
def test_all_reduce_equals_gloo_bitwise(pool, dtype, op, members, exact):
    """On two ranks any inputs (a + b is b + a); on more, inputs whose sum is exact in any order
    (gloo's ring adds in an order of its own); always the rank-order sum, on every rank."""
    numels = [1, 5, 33, 1000, 100_003, 0]
    results = pool.run(all_reduce, members, numels, dtype, op, exact, ranks=members)
    for per_numel in zip(*results):
        assert len({raw for _, raw, _, _ in per_numel}) == 1, "ranks differ"
        assert all(same_as_gloo and ordered for _, _, same_as_gloo, ordered in per_numel), per_numel[0][0]


def test_all_reduce_of_random_floats_on_four_ranks_is_the_rank_order_sum(pool):
    members = (0, 1, 2, 3)
    results = pool.run(all_reduce, members, [777, 50_000], torch.float32, "sum", False, ranks=members)
    for per_numel in zip(*results):
        assert len({raw for _, raw, _, _ in per_numel}) == 1
        assert all(ordered for *_, ordered in per_numel)


def integers_and_doubles() -> list:
    shm, gloo = pair((0, 1, 2, 3))
    out = []
    for dtype in (torch.int64, torch.float64, torch.uint8):
        a = (torch.arange(1001) % 7).to(dtype)
        b = a.clone()
        shm.all_reduce(a)
        gloo.all_reduce(b)
        out.append(torch.equal(a, b))
    others = (torch.complex64, torch.int16, torch.bool)  # not summed alike by every transport
    return out + [caught(be.all_reduce, torch.ones(3, dtype=dtype)) for be in (shm, gloo) for dtype in others]


def test_all_reduce_of_other_dtypes(pool):
    """shm summed int16, which gloo cannot (a RuntimeError mid-call), and gloo took bool, which
    shm refused: every backend now sums the same dtypes and refuses the rest with a TypeError."""
    results = pool.run(integers_and_doubles)
    assert all(r[:3] == [True] * 3 for r in results)
    assert all([kind for kind, _ in r[3:]] == ["TypeError"] * 6 for r in results)


def async_against_own_collectives() -> dict:
    import torch.distributed as dist

    members = (0, 1, 2, 3)
    shm, _ = pair(members)
    me = dist.get_rank()
    x = torch.full((200_000,), float(me + 1))
    handles = [shm.all_reduce(x, "sum", async_op=True)]
    gathered = torch.empty(4, 1000, dtype=torch.uint8)
    handles.append(shm.all_gather(torch.full((1000,), me, dtype=torch.uint8), gathered, async_op=True))
    mine = torch.full((10,), float(me))  # the caller's own collectives, on the same group, meanwhile
    dist.all_reduce(mine, group=group(members))
    dist.broadcast(mine, src=2, group=group(members))
    handles.append(shm.all_reduce(y := torch.ones(5), "mean", async_op=True))
    results = [h.wait() for h in handles]
    shm.barrier()
    return {
        "x": bool((x == 10.0).all()),
        "returned": results[0] is x and results[2] is y,
        "gathered": gathered[:, 0].tolist(),
        "mine": mine.tolist(),
        "y": y.tolist(),
    }


def test_async_calls_keep_their_order_beside_the_callers_collectives(pool):
    for r in pool.run(async_against_own_collectives):
        assert r == {"x": True, "returned": True, "gathered": [0, 1, 2, 3], "mine": [6.0] * 10, "y": [1.0] * 5}


def mismatched_calls() -> tuple | None:
    import torch.distributed as dist

    shm, _ = pair((0, 1))
    if dist.get_rank() == 0:  # 16 bytes per slot on both ranks, but different collectives
        return caught(shm.all_gather, torch.zeros(16, dtype=torch.uint8), torch.empty(2, 16, dtype=torch.uint8))
    return caught(shm.all_to_all, torch.zeros(2, 8, dtype=torch.uint8), torch.empty(2, 8, dtype=torch.uint8))


def still_works() -> list:
    shm, _ = pair((0, 1))
    x = torch.ones(4)
    shm.all_reduce(x)
    return x.tolist()


def test_ranks_making_different_calls_raise_valueerror_everywhere(pool):
    errors = pool.run(mismatched_calls, ranks=[0, 1])
    assert [e[0] for e in errors] == ["ValueError"] * 2 and "different calls" in errors[0][1]
    assert pool.run(still_works, ranks=[0, 1]) == [[2.0] * 4] * 2  # still in step


def sizes_that_differ(case: str) -> tuple:
    """Ranks 0 and 1 passing different sizes on a fresh backend (its own segment): at its first
    call, both beyond the first segment's size; after a small call, where only rank 1's needs a
    larger segment; or where rank 0's is empty. The error, how long it took, and a call after."""
    import torch.distributed as dist

    shm = backends.get("shm", group=group((0, 1)), timeout=10)
    rank = dist.get_rank()
    if case == "one-grows":
        shm.all_gather(torch.zeros(10, dtype=torch.uint8), torch.empty(2, 10, dtype=torch.uint8))
    size = {"first": 100_000 * (rank + 1), "one-grows": 10 if rank == 0 else 100_000, "one-empty": 5 * rank}[case]
    start = time.monotonic()
    error = caught(shm.all_gather, torch.zeros(size, dtype=torch.uint8), torch.empty(2, size, dtype=torch.uint8))
    took = time.monotonic() - start
    x = torch.ones(4)
    shm.all_reduce(x)
    return error, took, x.tolist()


@pytest.mark.parametrize("case", ["first", "one-grows", "one-empty"])
def test_ranks_passing_different_sizes_raise_valueerror_everywhere_at_once(pool, case):
    """The module promised a ValueError on every rank for ranks making different calls, but a
    size that needed a larger segment on one rank only sent that rank to make one while its peer
    waited in the present one: both timed out and the group broke (at the first call, the two
    sizes made segments that did not match: "ranks do not share memory"); an empty call on one
    rank returned at once and left the ranks out of step (from a probe)."""
    results = pool.run(sizes_that_differ, case, ranks=[0, 1])
    assert results[0][0] == results[1][0] and results[0][0][0] == "ValueError", results
    assert "different calls" in results[0][0][1]
    assert all(took < 5 and after == [2.0] * 4 for _, took, after in results), results


def two_segments_made_at_once(tries: int) -> list:
    """Fresh shm backends over ranks 0-2 and over 0-1 (each makes its first segment inside its
    first call, on its channel's worker thread), one async call on each in flight at once, a few
    times: the results' first elements, or the errors."""
    import torch.distributed as dist

    rank, out = dist.get_rank(), []
    for _ in range(tries):
        three = backends.get("shm", group=group((0, 1, 2)), timeout=10)
        two = backends.get("shm", group=group((0, 1)), timeout=10) if rank < 2 else None
        a, b = torch.full((100_000,), float(rank)), torch.full((100_000,), float(rank))
        calls = [compcomm.compressed_allreduce(a, compcomm.ErrorFeedback(), backend=three, async_op=True)]
        if two is not None:
            calls.append(compcomm.compressed_allreduce(b, compcomm.ErrorFeedback(), backend=two, async_op=True))
        try:
            out.append([call.wait()[0].item() for call in calls])
        except RuntimeError as exc:
            out.append(str(exc)[:200])
    return out


def test_segments_made_at_once_on_two_groups_do_not_wait_for_each_other(pool):
    """Each segment's rendezvous waited on the default store, whose client a process's threads
    share: a blocking wait on one thread held up the other's requests, so two rendezvous in
    flight at once (or one beside a transport being opened) waited for each other across ranks
    until the timeout, in four tries of five (from a probe). They poll the store now."""
    results = pool.run(two_segments_made_at_once, 3, ranks=[0, 1, 2])
    assert results == [[[1.0, 0.5]] * 3, [[1.0, 0.5]] * 3, [[1.0]] * 3], results


def behind_a_long_call() -> tuple:
    """A call queued behind a healthy call that takes longer than the backend's timeout (here a
    1.2 s task in the group's ordered lane, timeout 0.5 s): the queue has no bound of its own."""
    shm = backends.get("shm", group=group((1, 3)), timeout=0.5)
    shm.all_reduce(torch.ones(8))
    ahead = shm.ordered(time.sleep, 1.2, async_op=True)
    queued = caught(shm.all_reduce, torch.ones(8))
    ahead.wait()
    return queued, shm.all_reduce(torch.ones(8)).tolist()


def test_a_call_queued_behind_a_long_healthy_call_is_not_timed_out(pool):
    for queued, after in pool.run(behind_a_long_call, ranks=[1, 3]):
        assert queued is None and after == [2.0] * 8, queued


def never_arrives(members: tuple[int, ...], case: str) -> dict:
    """The group's last member skips a call: the first call of a fresh backend ("rendezvous"), or
    one on a backend that has worked ("mid-run"). The others time out; then that backend, and a
    fresh one over the same group (its peers are out of step), refuse calls at once; closing
    the backend still unmaps its segment."""
    import torch.distributed as dist

    shm = backends.get("shm", group=group(members), timeout=1.0)
    if case == "mid-run":
        shm.all_reduce(torch.ones(8))
    if dist.get_rank() == members[-1]:
        return {}
    out = {}
    for what, call in (("call", shm.all_reduce), ("after", shm.all_reduce), ("fresh", None)):
        if call is None:
            call = backends.get("shm", group=group(members), timeout=60.0).all_reduce
        start = time.monotonic()
        out[what] = (caught(call, torch.ones(8)), time.monotonic() - start)
    mapped = _mapped()
    out["closed"] = (caught(shm.close), mapped - _mapped())
    return out


@pytest.mark.parametrize("members, case", [(ABSENT_GROUP, "mid-run"), (ABSENT_RENDEZVOUS_GROUP, "rendezvous")])
def test_a_peer_that_never_arrives_raises_runtimeerror_within_the_timeout(pool, members, case):
    waiting, _ = pool.run(never_arrives, members, case, ranks=members)
    (kind, message), seconds = waiting["call"]
    assert kind == "RuntimeError" and "1s" in message, message
    assert 0.9 < seconds < 5
    if case == "mid-run":
        assert f"rank(s) [{len(members) - 1}]" in message
    for what in ("after", "fresh"):  # the backend, and any other over the group, refuse at once
        (kind, message), seconds = waiting[what]
        assert kind == "RuntimeError" and "unusable" in message and seconds < 0.5, (what, message)
    refused, unmapped = waiting["closed"]  # close() works on a broken group (it raised before)
    assert refused is None and (unmapped >= 1 or case == "rendezvous"), waiting["closed"]
    assert leftovers(pool) == []


def _dying_rank(rank: int, port: int, results) -> None:
    import torch.distributed as dist

    os.environ.update(rank_environment(rank, 2, port))
    dist.init_process_group("gloo")
    shm = backends.get("shm", timeout=60.0)
    shm.all_reduce(torch.ones(1000))
    if rank == 1:
        os._exit(3)  # dies without a word, between two calls
    start = time.monotonic()
    error = caught(shm.all_reduce, torch.ones(1000))
    results.put((error, time.monotonic() - start))


def test_a_peer_that_dies_fails_the_call_fast_not_after_the_timeout():
    [((kind, message), seconds)], pids = reports_of_dying_ranks(_dying_rank, 2, 1, timeout=60)
    assert kind == "RuntimeError" and "exited" in message and "[1]" in message, message
    assert seconds < 5  # the timeout was 60 s
    assert _names(pids) == []


def leaving_peer() -> tuple | None:
    """Ranks 1 and 2 over a group of their own (its channel breaks); rank 2 abandons the group
    after a call, as a hierarchical call whose other level failed does."""
    import torch.distributed as dist

    mine = dist.new_group([1, 2])  # made by every rank
    if dist.get_rank() not in (1, 2):
        return None
    shm = backends.get("shm", group=mine, timeout=60.0)
    shm.all_reduce(torch.ones(8))
    if dist.get_rank() == 2:
        shm.abandon("its other group failed")
        return caught(shm.all_reduce, torch.ones(8)), 0.0
    start = time.monotonic()
    return caught(shm.all_reduce, torch.ones(8)), time.monotonic() - start


def test_a_peer_that_abandons_the_group_fails_the_waiting_call_fast(pool):
    """The waiting rank learned nothing and waited for the whole timeout, or paired with the
    abandoning rank's next call and raised ValueError ("ranks made different calls")."""
    _, (waiting, seconds), (left, _), _ = pool.run(leaving_peer)
    assert waiting[0] == "RuntimeError" and "left a call" in waiting[1] and seconds < 5, (waiting, seconds)
    assert left[0] == "RuntimeError" and "unusable" in left[1], left


def _names(pids) -> list[str]:
    mine = {f"{PREFIX}{pid}-" for pid in pids}
    return [e for e in os.listdir(SHM_DIRECTORY) if any(e.startswith(m) for m in mine)]


def rank_pid() -> int:
    return os.getpid()


def leftovers(pool) -> list[str]:
    """Segment names in /dev/shm created by the pool's ranks (each unlinks its own right after
    every peer has mapped it)."""
    return _names(pool.run(rank_pid))


def close_and_look() -> dict:
    shm = backends.get("shm", group=group(4))
    shm.all_reduce(torch.ones(100_000))
    before = _mapped()
    shm.close()
    return {"before": before, "after": _mapped(), "refused": caught(shm.barrier)}


def _mapped() -> int:
    return sum(PREFIX in line for line in Path("/proc/self/maps").read_text().splitlines())


def test_nothing_left_in_dev_shm_and_close_unmaps(pool):
    results = pool.run(close_and_look)
    assert leftovers(pool) == []
    for r in results:
        assert r["before"] >= 1 and r["after"] == r["before"] - 1
        assert r["refused"][0] == "RuntimeError" and "closed" in r["refused"][1]


def apart(tmp: str) -> tuple | None:
    """Ranks that do not share a directory (as ranks of two hosts do not share /dev/shm)."""
    import torch.distributed as dist

    directory = Path(tmp, f"rank{dist.get_rank()}")
    directory.mkdir()
    shm = backends.get("shm", group=group(2), timeout=30.0, directory=str(directory))
    return caught(shm.all_reduce, torch.ones(4))


def test_ranks_that_share_no_memory_raise_on_every_rank(pool, tmp_path):
    errors = pool.run(apart, str(tmp_path), ranks=[0, 1])
    assert [e[0] for e in errors] == ["RuntimeError"] * 2
    assert all("do not share memory" in e[1] and "one host" in e[1] for e in errors), errors
    assert [p.name for p in tmp_path.rglob("*") if p.is_file()] == []


def test_shm_without_process_group_says_init_process_group():
    assert not torch.distributed.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        backends.get("shm")


def exchanged_blocks_summed(members: tuple[int, ...], numel: int, dtype: torch.dtype) -> dict:
    """shm's exchanged blocks, summed in rank order, against gloo's all-to-all of the
    zero-padded fp32 blocks and the same sum (the node sum of the hierarchical schedule over
    either transport)."""
    import torch.distributed as dist

    shm, gloo = pair(members)
    n, me = shm.world_size, members.index(dist.get_rank())
    size = -(-numel // n)
    x = (torch.randn(numel, generator=torch.Generator().manual_seed(me + numel)) * 5).to(dtype)
    out = torch.full((size,), float("nan"))
    sent = shm.bytes_sent
    shm.exchange_blocks(x, size, torch.float32, lambda blocks: sum_in_rank_order(blocks, out))
    blocks = torch.zeros(n, size)
    blocks.view(-1)[:numel].copy_(x)
    received = torch.empty_like(blocks)
    gloo.all_to_all(blocks.view(torch.uint8), received.view(torch.uint8))
    expected = received[0].clone()
    for row in received[1:]:
        expected += row
    return {"same": torch.equal(out, expected), "sent": shm.bytes_sent - sent == (n - 1) * size * 4}


def combine_fails_on_one_rank(members: tuple[int, ...]) -> dict:
    """Rank 1's combine raises: the segment is released all the same, so the next exchange
    and all-reduce of every rank are right."""
    import torch.distributed as dist

    shm, _ = pair(members)
    me, n = members.index(dist.get_rank()), len(members)
    x = torch.arange(n * 4, dtype=torch.float32) + me

    def failing(blocks: list[torch.Tensor]) -> None:
        if me == 1:
            raise ZeroDivisionError("combine failed")

    raised = caught(lambda: shm.exchange_blocks(x, 4, torch.float32, failing))
    out = torch.empty(4)
    shm.exchange_blocks(x, 4, torch.float32, lambda blocks: sum_in_rank_order(blocks, out))
    expected = sum(torch.arange(me * 4, me * 4 + 4, dtype=torch.float32) + q for q in range(n))
    total = torch.ones(3)
    shm.all_reduce(total, "sum")
    return {"raised": raised is not None, "sum": torch.equal(out, expected), "all_reduce": total.tolist() == [n] * 3}


def test_a_combine_that_raises_leaves_the_backend_usable(pool):
    results = pool.run(combine_fails_on_one_rank, (0, 1, 2), ranks=(0, 1, 2))
    assert [r["raised"] for r in results] == [False, True, False]
    assert all(r["sum"] and r["all_reduce"] for r in results)


@pytest.mark.parametrize("members", [(0, 1), (0, 1, 2), (0, 1, 2, 3)])
@pytest.mark.parametrize("numel, dtype", [(1000, torch.float32), (1001, torch.float32), (5, torch.bfloat16)])
def test_exchanged_blocks_summed_are_the_all_to_all_and_rank_order_sum_bitwise(pool, members, numel, dtype):
    for r in pool.run(exchanged_blocks_summed, members, numel, dtype, ranks=members):
        assert r == {"same": True, "sent": True}

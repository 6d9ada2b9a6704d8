"""The hierarchical backend on real gloo ranks: 2 nodes x 2 ranks and 2 nodes x 3 ranks (six
spawned ranks), against a float64 model of its numerics built on the reference of the flat
algorithm; bitwise identical results, with gloo or shared memory inside the node alike; errors
raised on every rank with nothing changed; byte collectives composed from the two levels; an
optimizer and the coalesced call on top of it."""

from __future__ import annotations

import hashlib
import math

import numpy as np
import pytest
import torch
from test_error_feedback_out import check_out_against_in_place, out_against_in_place

import compcomm
from compcomm.layout import chunk_size, padded_size, real_count

from rankpool import RankPool, caught, reports_of_dying_ranks
from reference import assert_close, reference_allreduce

_backends: dict[str, object] = {}  # per rank process: layout name -> its HierarchicalBackend
LAYOUTS = {"2x2": (2, 2), "2x3": (2, 3)}  # nodes x ranks per node; gloo inside the node
SHM = {f"{layout}/shm": shape for layout, shape in LAYOUTS.items()}  # shared memory inside the node
SINGLE = {"1x6/shm": (1, 6)}  # one node: the 1-bit call across nodes has one rank


def _build() -> None:
    """On all six ranks at once: the two layouts' groups (group creation is collective)."""
    import torch.distributed as dist

    from compcomm import backends

    rank = dist.get_rank()
    _backends["2x3"] = backends.get("hierarchical", local_world_size=3, intra="gloo")
    _backends["2x3/shm"] = backends.get("hierarchical", local_world_size=3)  # shm: the default on CPU
    _backends["1x6/shm"] = backends.get("hierarchical", local_world_size=6)
    node = [dist.new_group(r) for r in ([0, 1], [2, 3])]
    peer = [dist.new_group(r) for r in ([0, 2], [1, 3])]
    if rank < 4:
        for intra, name in (("gloo", "2x2"), ("shm", "2x2/shm")):
            _backends[name] = backends.hierarchical(
                backends.get(intra, group=node[rank // 2]), backends.get("gloo", group=peer[rank % 2])
            )


@pytest.fixture(scope="module")
def six():
    ranks = RankPool(world_size=6)
    ranks.run(_build)
    yield ranks
    ranks.close()


def ranks_of(layout: str) -> range:
    nodes, k = {**LAYOUTS, **SHM, **SINGLE}[layout]
    return range(nodes * k)


def make_input(rank: int, step: int, numel: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step * 1009 + rank)
    return torch.randn(numel, generator=g) * (rank + 1) + 0.1 * step


def run_steps(layout: str, numel: int, op: str, steps: int, double_buffer: bool = True) -> list[dict]:
    be = _backends[layout]
    ef = compcomm.ErrorFeedback(double_buffer=double_buffer)
    records = []
    for step in range(steps):
        x = make_input(be.rank, step, numel)
        t = x.clone()
        assert compcomm.compressed_allreduce(t, ef, backend=be, op=op) is t
        records.append(
            {
                "input": x.double().numpy(),
                "output": t.double().numpy(),
                "raw": t.numpy().tobytes(),
                "worker": ef.worker_error.double().numpy(),
                "server": ef.server_error.double().numpy(),
            }
        )
    return records


def reference(inputs: list[np.ndarray], k: int, op: str, state: dict) -> tuple[np.ndarray, dict]:
    """The hierarchical call in float64: node sums (means) of each part, then the flat 1-bit
    reference over the nodes on each part. `state[i]` = (worker (H, M_i), server (H, C_i))."""
    hosts, numel = len(inputs) // k, inputs[0].size
    size = chunk_size(numel, k)
    out, new = np.zeros(numel), {}
    for i in range(k):
        lo, n_i = i * size, real_count(i, numel, k)
        nodes = [
            sum(inputs[h * k + j][lo : lo + n_i] for j in range(k)) / (k if op == "mean" else 1) for h in range(hosts)
        ]
        worker, server = state.get(
            i, (np.zeros((hosts, padded_size(n_i, hosts))), np.zeros((hosts, chunk_size(n_i, hosts))))
        )
        if n_i:
            out[lo : lo + n_i], worker, server = reference_allreduce(nodes, worker, server, op)
        new[i] = (worker, server)
    return out, new


@pytest.mark.parametrize("layout", [*LAYOUTS, *SHM, *SINGLE])
@pytest.mark.parametrize("numel", [1, 7, 48, 100, 1001])  # 48: parts need no padding
@pytest.mark.parametrize("op", ["mean", "sum"])
def test_matches_float64_reference_bitwise_equal_everywhere(six, layout, numel, op):
    """Also on one node (1x6: a part's result rows start at odd byte offsets, which the decode
    read as fp32 in place and failed on)."""
    hosts, k = {**LAYOUTS, **SHM, **SINGLE}[layout]
    steps = 3
    per_rank = six.run(run_steps, layout, numel, op, steps, ranks=ranks_of(layout))
    state: dict = {}
    for step in range(steps):
        records = [per_rank[r][step] for r in ranks_of(layout)]
        assert len({rec["raw"] for rec in records}) == 1, "outputs differ between ranks"
        expected, new = reference([rec["input"] for rec in records], k, op, state)
        scale = np.abs(expected).max()
        assert_close(records[0]["output"], expected, rtol=1e-5, atol=1e-5 * scale)
        for i in range(k):  # rank (h, i) holds part i's errors of node h
            got_w = np.stack([records[h * k + i]["worker"] for h in range(hosts)])
            got_s = np.stack([records[h * k + i]["server"] for h in range(hosts)])
            assert_close(got_w, new[i][0], rtol=1e-5, atol=1e-5 * scale)
            assert_close(got_s, new[i][1], rtol=1e-5, atol=1e-5 * scale)
            state[i] = (got_w, got_s)  # the next step from our state: no drift from rounding


def bits_of(steps: list[dict]) -> str:
    """A digest of the bits of every step's output and error states (what the ranks send back
    instead of hundreds of MB of them: equal digests, equal bits)."""
    return hashlib.sha256(b"".join(r["raw"] + r["worker"].tobytes() + r["server"].tobytes() for r in steps)).hexdigest()


def both_intra(layout: str, numel: int, op: str) -> list[str]:
    """The same steps with gloo and with shared memory inside the node: outputs and error states."""
    return [bits_of(run_steps(name, numel, op, 3)) for name in (layout, f"{layout}/shm")]


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("numel", [7, 1001, 70_001])
def test_shm_inside_the_node_gives_bitwise_what_gloo_gives(six, layout, numel):
    for via_gloo, via_shm in six.run(both_intra, layout, numel, "mean", ranks=ranks_of(layout)):
        assert via_gloo == via_shm


def formed_and_written(layout: str, numel: int, op: str) -> list[str]:
    """The same steps with the node's mean formed inside the worker scan (the default: the scan
    writes x') and written out before it (double_buffer=False: no x' buffer to write into)."""
    return [bits_of(run_steps(layout, numel, op, 3, double_buffer)) for double_buffer in (True, False)]


@pytest.mark.parametrize(
    "layout, numel, op",
    [
        *(
            (layout, numel, op)
            for layout, numel in [("2x2/shm", 1001), ("2x3/shm", 1001), ("2x3", 1001), ("2x3/shm", 7)]
            for op in ("mean", "sum")
        ),
        ("2x2/shm", 4_200_000, "mean"),
    ],
)
def test_mean_formed_in_the_scan_gives_the_bits_of_the_written_one(six, layout, numel, op):
    """The scan that reads the node's blocks in place (k = 2: both; k = 3: the first two summed,
    the third added in the scan), on shared memory and on gloo's all-to-all, against the node
    step that writes the sum and divides it: the same outputs and error states, bit for bit.
    4.2M elements: chunks across nodes of more than CHUNKED_SCAN_ELEMENTS, scanned one by one
    while phase 1 streams."""
    for formed, written in six.run(formed_and_written, layout, numel, op, ranks=ranks_of(layout)):
        assert formed == written


def bad_call(layout: str, case: str) -> dict:
    """A good call, then one where one rank's input is bad; then another good call."""
    be = _backends[layout]
    rank, numel = be.rank, 257
    ef = compcomm.ErrorFeedback()
    compcomm.compressed_allreduce(make_input(rank, 0, numel), ef, backend=be)
    before = (ef.worker_error.clone(), ef.server_error.clone())
    t, op = make_input(rank, 1, numel), "mean"
    culprit = be.world_size - 1
    if rank == culprit:
        if case == "nan":
            t[3] = float("nan")
        elif case == "int":
            t = torch.arange(numel)
        elif case == "numel":
            t = make_input(rank, 1, numel + 1)
        elif case == "op":
            op = "sum"
    if case == "overflow":
        t = torch.full((numel,), 3e38)
    if case == "fp16_sum":
        t, op = torch.full((numel,), 30000.0, dtype=torch.float16), "sum"
    if case == "fp16_sum" or case == "overflow":
        ef = compcomm.ErrorFeedback()
        before = (None, None)
    original = t.clone()
    error = caught(compcomm.compressed_allreduce, t, ef, backend=be, op=op)
    unchanged = t.numpy().tobytes() == original.numpy().tobytes()  # NaN-proof
    if before[0] is None:
        state_kept = ef.worker_error is None
    else:
        state_kept = torch.equal(ef.worker_error, before[0]) and torch.equal(ef.server_error, before[1])
    after = make_input(rank, 2, numel)
    compcomm.compressed_allreduce(after, compcomm.ErrorFeedback(), backend=be)
    return {"error": error, "unchanged": unchanged, "state_kept": state_kept, "after": after.numpy().tobytes()}


@pytest.mark.parametrize("layout", [*LAYOUTS, *SHM])
@pytest.mark.parametrize(
    "case, kind",
    [
        ("nan", "NonFiniteError"),
        ("int", "TypeError"),
        ("numel", "ValueError"),
        ("op", "ValueError"),
        ("overflow", "NonFiniteError"),
        ("fp16_sum", "NonFiniteError"),
    ],
)
def test_bad_input_on_one_rank_raises_the_same_error_everywhere(six, layout, case, kind):
    results = six.run(bad_call, layout, case, ranks=ranks_of(layout))
    errors = {r["error"] for r in results}
    assert len(errors) == 1 and next(iter(errors)) is not None, errors
    assert next(iter(errors))[0] == kind, errors
    assert all(r["unchanged"] and r["state_kept"] for r in results), results
    assert len({r["after"] for r in results}) == 1  # the group still works, in step


def flat_then_hierarchical() -> tuple | None:
    ef = compcomm.ErrorFeedback()
    rank = _backends["2x3"].rank
    compcomm.compressed_allreduce(make_input(rank, 0, 100), ef, backend=compcomm.backends.get("gloo"))
    return caught(compcomm.compressed_allreduce, make_input(rank, 1, 100), ef, backend=_backends["2x3"])


def test_an_error_feedback_of_a_flat_call_is_refused_by_a_hierarchical_one_saying_why(six):
    """The refusal named sizes the caller never passed (this rank's part over the nodes)."""
    results = six.run(flat_then_hierarchical)
    assert len(set(results)) == 1 and results[0][0] == "ValueError", results
    assert "Over a hierarchical backend an ErrorFeedback holds this rank's part" in results[0][1]


def another_ranks_state(layout: str, node_peer: bool) -> dict:
    """Two calls, then each rank resumes from another rank's state and makes a third call: the
    rank with its place on the other node (`node_peer`: the same part of the tensor, the other
    node's errors), or the next rank of its own node (another part, of the same size where the
    parts are even: the save-on-LOCAL_RANK-0 habit)."""
    from compcomm.gather_objects import all_gather_object

    be = _backends[layout]
    ef = compcomm.ErrorFeedback(tag="resumed")
    for step in range(2):
        compcomm.compressed_allreduce(make_input(be.rank, step, 1056), ef, backend=be)
    states = all_gather_object(ef.state_dict(), be)
    k = be.intra.world_size
    resumed = compcomm.ErrorFeedback(tag="resumed")
    node, local = divmod(be.rank, k)
    source = (be.rank + k) % be.world_size if node_peer else node * k + (local + 1) % k
    resumed.load_state_dict(states[source])
    t = make_input(be.rank, 2, 1056)
    original = t.clone()
    return {"error": caught(compcomm.compressed_allreduce, t, resumed, backend=be), "kept": torch.equal(t, original)}


@pytest.mark.parametrize("node_peer", [True, False])
@pytest.mark.parametrize("layout", ["2x2", "2x3/shm"])
def test_another_ranks_error_state_is_refused_on_every_rank(six, layout, node_peer):
    """Over a hierarchical backend an ErrorFeedback holds its node's errors of this rank's part:
    the state of the rank holding the same part on another node, or another part of the same
    size on this node, is refused on every rank (it loaded and gave wrong sums before)."""
    results = six.run(another_ranks_state, layout, node_peer, ranks=ranks_of(layout))
    assert all(r["error"] is not None and r["error"][0] == "ValueError" and r["kept"] for r in results), results


def byte_collectives(layout: str) -> dict:
    import torch.distributed as dist

    be = _backends[layout]
    n, rank = be.world_size, be.rank
    send = torch.arange(5, dtype=torch.uint8) + 10 * rank
    gathered = torch.empty(n, 5, dtype=torch.uint8)
    be.all_gather(send, gathered)
    blocks = (torch.arange(n * 3, dtype=torch.uint8).view(n, 3) + 100 * rank % 256).to(torch.uint8)
    received = torch.empty_like(blocks)
    be.all_to_all(blocks, received)
    total = torch.arange(11, dtype=torch.int64) * (rank + 1)
    be.all_reduce(total, "sum")
    mean = torch.full((7,), float(rank))
    be.all_reduce(mean, "mean")
    weight = torch.full((3,), float(rank), requires_grad=True)  # a parameter: its data is reduced
    be.all_reduce(weight, "mean")
    be.barrier()
    return {
        "gathered": gathered.tolist(),
        "received": received.tolist(),
        "total": total.tolist(),
        "mean": mean.tolist(),
        "weight": weight.detach().tolist(),
        "rank": be.rank,
        "global": dist.get_rank(),
    }


@pytest.mark.parametrize("layout", [*LAYOUTS, *SHM])
def test_byte_collectives_compose_the_two_levels(six, layout):
    results = six.run(byte_collectives, layout, ranks=ranks_of(layout))
    n = len(results)
    for r, res in enumerate(results):
        assert res["rank"] == res["global"] == r
        assert res["gathered"] == [[10 * q + i for i in range(5)] for q in range(n)]
        assert res["received"] == [[(r * 3 + i + 100 * q % 256) % 256 for i in range(3)] for q in range(n)]
        assert res["total"] == [i * n * (n + 1) // 2 for i in range(11)]
        assert res["mean"] == [sum(range(n)) / n] * 7
        assert res["weight"] == [sum(range(n)) / n] * 3


def coalesced_all_or_nothing(layout: str) -> dict:
    be = _backends[layout]
    rank = be.rank
    efs = [compcomm.ErrorFeedback("a"), compcomm.ErrorFeedback("b")]
    good = [make_input(rank, 0, 50), make_input(rank, 1, 33)]
    compcomm.compressed_allreduce_coalesced(good, efs, backend=be)
    before = [ef.worker_error.clone() for ef in efs]
    bad = [make_input(rank, 2, 50), make_input(rank, 3, 33)]
    if rank == 1:
        bad[1][0] = float("inf")
    error = caught(compcomm.compressed_allreduce_coalesced, bad, efs, backend=be)
    kept = all(torch.equal(ef.worker_error, b) for ef, b in zip(efs, before))
    one_by_one = [make_input(rank, 0, 50), make_input(rank, 1, 33)]
    for t, tag in zip(one_by_one, "ab"):
        compcomm.compressed_allreduce(t, compcomm.ErrorFeedback(tag), backend=be)
    return {
        "good": b"".join(t.numpy().tobytes() for t in good),
        "error": error,
        "kept": kept,
        "same_as_separate_calls": all(torch.equal(a, b) for a, b in zip(good, one_by_one)),
    }


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_coalesced_call_through_hierarchical_is_all_or_nothing(six, layout):
    results = six.run(coalesced_all_or_nothing, layout, ranks=ranks_of(layout))
    assert len({r["good"] for r in results}) == 1
    assert len({r["error"] for r in results}) == 1 and results[0]["error"][0] == "NonFiniteError"
    assert all(r["kept"] and r["same_as_separate_calls"] for r in results)


def out_call(layout: str, numel: int) -> list[dict]:
    return out_against_in_place(_backends[layout], numel, 3)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_error_feedback_out_through_hierarchical_is_the_in_place_call(six, layout):
    check_out_against_in_place(six.run(out_call, layout, 1001, ranks=ranks_of(layout)))


def train(layout: str, steps: int) -> dict:
    from compcomm.optim import OnebitAdam

    be = _backends[layout]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = OnebitAdam(model.parameters(), lr=1e-2, freeze_step=2, backend=be)
    g = torch.Generator().manual_seed(be.rank)
    losses = []
    for _ in range(steps):
        x = torch.randn(32, 8, generator=g)
        loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return {"params": b"".join(p.detach().numpy().tobytes() for p in model.parameters()), "losses": losses}


@pytest.mark.parametrize("layout", [*LAYOUTS, *SHM])
def test_onebit_adam_over_hierarchical_keeps_ranks_identical(six, layout):
    results = six.run(train, layout, 12, ranks=ranks_of(layout))
    assert len({r["params"] for r in results}) == 1, "parameters differ between ranks"
    losses = results[0]["losses"]
    assert all(math.isfinite(v) for v in losses) and min(losses[-3:]) < losses[0]


def test_get_needs_a_divisible_world_and_known_transports(six):
    for options in ({"local_world_size": 4}, {"local_world_size": 3, "intra": "tcp"}, {"transport": "shm"}):
        assert {r[0] for r in six.run(_wrong_layout, options)} == {"ValueError"}


def _misgrouped() -> tuple | None:
    import torch.distributed as dist

    from compcomm import backends

    rank = dist.get_rank()
    node = [dist.new_group(r) for r in ([0, 1], [2, 3])]  # group creation: all six ranks
    crossed = [dist.new_group(r) for r in ([0, 3], [1, 2])]  # local index 0 with 1: not one index
    if rank >= 4:
        return None
    inter = crossed[0] if rank in (0, 3) else crossed[1]
    return caught(backends.hierarchical, backends.get("gloo", group=node[rank // 2]), backends.get("gloo", group=inter))


def test_inter_groups_that_mix_local_indices_are_refused_everywhere(six):
    """Ranks 0 and 3 (local indices 0 and 1) as one inter group: each node's parts would be
    summed with the other index's, different results on different ranks (no error before)."""
    results = six.run(_misgrouped)[:4]
    assert all(r is not None and r[0] == "ValueError" and "one local index" in r[1] for r in results), results


def _nodes_in_other_orders() -> tuple | None:
    import torch.distributed as dist

    from compcomm import backends

    rank = dist.get_rank()
    node = [dist.new_group(r) for r in ([0, 3], [1, 2])]  # group creation: all six ranks
    peer = [dist.new_group(r) for r in ([0, 1], [2, 3])]  # index 0 lists node {0,3} first, index 1 node {1,2}
    if rank >= 4:
        return None
    mine = node[0] if rank in (0, 3) else node[1]
    inter = peer[0] if rank in (0, 1) else peer[1]
    return caught(backends.hierarchical, backends.get("gloo", group=mine), backends.get("gloo", group=inter))


def test_inter_groups_that_order_the_nodes_differently_are_refused_everywhere(six):
    """Each inter group joins one local index, but index 0 lists the nodes in another order than
    index 1: composite rank r was not one rank, so the byte collectives' rows and an optimizer's
    equalized start differed by rank (parameters drifted apart silently)."""
    results = six.run(_nodes_in_other_orders)[:4]
    assert all(r is not None and r[0] == "ValueError" and "order" in r[1] for r in results), results


def _local_world_size_by_rank(sizes: list[int]) -> tuple | None:
    import torch.distributed as dist

    from compcomm import backends

    return caught(backends.get, "hierarchical", local_world_size=sizes[dist.get_rank()], intra="gloo")


@pytest.mark.parametrize("sizes", [[2, 2, 2, 2, 3, 3], [4, 4, 4, 4, 2, 2], [3.0, 3, 3, 3, 3, 3], [True] * 6])
def test_ranks_that_disagree_on_the_node_size_are_refused_everywhere(six, sizes):
    """The ranks made their groups from their own LOCAL_WORLD_SIZE: every rank hung in
    new_group, or those whose size divided the world did while the others raised. A float on
    one rank compared equal to the others' integer and raised there alone, leaving the others
    in new_group until the timeout; True passed for nodes of one rank."""
    results = six.run(_local_world_size_by_rank, sizes)
    assert all(r is not None and r[0] == "ValueError" and "local_world_size" in r[1] for r in results), results


def group_timeouts() -> list[float]:
    from compcomm.backends.torch_dist import group_timeout

    cpu = torch.device("cpu")
    gloo, shm = _backends["2x3"], _backends["2x3/shm"]
    return [
        group_timeout(None, cpu).total_seconds(),
        group_timeout(gloo.intra.group, cpu).total_seconds(),
        group_timeout(gloo.inter.group, cpu).total_seconds(),
        shm.intra.timeout,
    ]


def test_get_hierarchical_keeps_the_default_groups_timeout(six):
    """The groups it makes had torch's 30 minutes, whatever init_process_group's timeout: a
    stalled peer held every rank that long."""
    for world, intra, inter, shm in six.run(group_timeouts):
        assert world == 60.0 and intra == inter == shm == world


def _wrong_layout(options: dict) -> tuple | None:
    from compcomm import backends

    return caught(backends.get, "hierarchical", **{"local_world_size": 3, **options})


def empty_flat() -> dict:
    import torch.distributed as dist

    from rankpool import group

    if dist.get_rank() >= 2:
        return {}
    ef = compcomm.ErrorFeedback()
    t = torch.zeros(0)
    compcomm.compressed_allreduce(t, ef, backend=compcomm.backends.get("gloo", group=group(2)))
    return {"numel": t.numel(), "worker": ef.worker_error.numel(), "server_max": ef.server_error_max()}


def test_empty_tensor_on_the_flat_collective(six):
    """An empty part (more local ranks than 8-element blocks) is an empty call across nodes."""
    assert six.run(empty_flat, ranks=[0, 1]) == [{"numel": 0, "worker": 0, "server_max": 0.0}] * 2


def below_threshold(layout: str) -> dict:
    """A coalesced call where the first tensor goes uncompressed (min_compress_bytes) and the
    second is compressed."""
    be = _backends[layout]
    efs = [compcomm.ErrorFeedback("small"), compcomm.ErrorFeedback("large")]
    x = [make_input(be.rank, 0, 301), make_input(be.rank, 1, 5000)]
    t = [v.clone() for v in x]
    compcomm.compressed_allreduce_coalesced(t, efs, backend=be, min_compress_bytes=4 * 1000)
    return {
        "input": x[0].numpy(),
        "output": t[0].numpy().tobytes(),
        "large": t[1].numpy().tobytes(),
        "small_errors": (efs[0].worker_error, efs[0].server_error),
        "large_used": efs[1].worker_error is not None,
    }


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_min_compress_bytes_through_hierarchical_is_the_exact_mean_of_node_means(six, layout):
    hosts, k = LAYOUTS[layout]
    results = six.run(below_threshold, layout, ranks=ranks_of(layout))
    assert len({r["output"] for r in results}) == 1 and len({r["large"] for r in results}) == 1
    assert all(r["small_errors"] == (None, None) and r["large_used"] for r in results)
    inputs = [torch.from_numpy(r["input"]) for r in results]
    means = []
    for h in range(hosts):  # node sums in local rank order, then / k (fp32), as documented
        total = inputs[h * k].clone()
        for j in range(1, k):
            total += inputs[h * k + j]
        means.append(total / k)
    expected = means[0].clone()
    for mean in means[1:]:
        expected += mean
    expected /= hosts
    assert results[0]["output"] == expected.numpy().tobytes()


def node_call_then_composite() -> dict:
    """Node 0's ranks reduce over their own group first (a legitimate node-local call), then
    all four make a hierarchical call."""
    from rankpool import group

    be = _backends["2x2"]
    if be.rank < 2:
        compcomm.compressed_allreduce(
            torch.ones(10), compcomm.ErrorFeedback(), backend=compcomm.backends.get("gloo", group=group(2))
        )
    t = make_input(be.rank, 0, 100)
    return {
        "error": caught(compcomm.compressed_allreduce, t, compcomm.ErrorFeedback(), backend=be),
        "out": t.numpy().tobytes(),
    }


def test_a_node_local_call_does_not_put_the_composite_out_of_step(six):
    """Regression: the composite compared the intra groups' call tickets across nodes, so one
    node's own call on its group made the next hierarchical call fail as 'out of step'."""
    results = six.run(node_call_then_composite, ranks=ranks_of("2x2"))
    assert [r["error"] for r in results] == [None] * 4
    assert len({r["out"] for r in results}) == 1


def tiny_exact(numel: int) -> dict:
    be = _backends["2x2"]
    t = make_input(be.rank, 0, numel)
    return {
        "error": caught(
            compcomm.compressed_allreduce, t, compcomm.ErrorFeedback(), backend=be, min_compress_bytes=1 << 20
        ),
        "out": t.numpy().tobytes(),
    }


@pytest.mark.parametrize("numel", [3, 20])  # 3: the part of local index 1 is empty
def test_tiny_tensor_below_min_compress_bytes(six, numel):
    """Regression: an empty part on the exact path failed to decode on its ranks after the
    node had agreed, and their node peers waited in the result's all-gather."""
    results = six.run(tiny_exact, numel, ranks=ranks_of("2x2"))
    assert [r["error"] for r in results] == [None] * 4
    assert len({r["out"] for r in results}) == 1


def _killed_peer(rank: int, port: int, results) -> None:
    """2 nodes x 2 ranks (shm inside); rank 3 dies in its second call, once the call's agreement
    has passed, as its phases 1-2 across nodes begin (its own `FlatCall.commit` exits the
    process: the fault is injected into the dying rank only). Each survivor reports the error
    of that call and of its next one, and how long they took."""
    import datetime
    import os
    import time

    import torch.distributed as dist

    from compcomm.launch import rank_environment
    from compcomm.schedules import flat

    os.environ.update(rank_environment(rank, 4, port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=20))
    be = compcomm.backends.get("hierarchical", local_world_size=2)
    ef = compcomm.ErrorFeedback()
    compcomm.compressed_allreduce(torch.randn(100_000), ef, backend=be)
    if rank == 3:
        flat.FlatCall.commit = lambda self: os._exit(9)  # type: ignore[method-assign]
    start = time.monotonic()
    error = caught(compcomm.compressed_allreduce, torch.randn(100_000), ef, backend=be)
    again = caught(compcomm.compressed_allreduce, torch.randn(100_000), ef, backend=be)
    results.put((rank, error, again, time.monotonic() - start))
    results.close()
    results.join_thread()  # flushed before the exit, which skips the broken groups' teardown
    os._exit(0)


def test_a_peer_killed_mid_run_fails_every_survivor_with_runtimeerror():
    """Rank 1, whose phases across nodes failed with rank 3, left its node peer waiting mid-call
    in shared memory, then paired its next call with the peer's pending one: ValueError ("ranks
    made different calls") on ranks 0 and 1, RuntimeError on rank 2."""
    reports, _ = reports_of_dying_ranks(_killed_peer, 4, 3)
    for rank, error, again, seconds in sorted(reports):
        assert error is not None and error[0] == "RuntimeError", (rank, error)
        assert again is not None and again[0] == "RuntimeError", (rank, again)
        assert seconds < 40, (rank, seconds)


def node_sum_overflow(layout: str) -> tuple | None:
    import torch.distributed as dist

    if dist.get_rank() not in ranks_of(layout):
        return None
    x = torch.full((1000,), 1.0)
    x[0] = 3e38  # the mean is finite, the node's fp32 sum is not
    return caught(compcomm.compressed_allreduce, x, compcomm.ErrorFeedback(), backend=_backends[layout])


def test_a_node_sum_that_overflows_says_so(six):
    """The refusal read "non-finite values (NaN/Inf) in the input or error state of rank(s)
    [0, 1]" for finite inputs, naming node indices as if they were ranks."""
    for r in six.run(node_sum_overflow, "2x2/shm")[:4]:
        assert r is not None and r[0] == "NonFiniteError" and "node's fp32 sum" in r[1], r


def checkpoint_across_layouts(saved_on: str, loaded_on: str, diloco: bool) -> tuple | None:
    """OnebitAdam trained into its 1-bit stage (or DiLoCo past a sync) over one layout of ranks
    0-3, its state loaded into one over the other (flat: one gloo group of the four)."""
    from compcomm.optim import DiLoCo, OnebitAdam

    from rankpool import group

    layouts = {"flat": compcomm.backends.get("gloo", group=group(4)), "2x2": _backends["2x2"]}
    states = []
    for layout in (saved_on, loaded_on):
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 4)
        if diloco:
            inner = torch.optim.SGD(model.parameters(), lr=1e-2)
            opt = DiLoCo(model.parameters(), inner, sync_every=2, backend=layouts[layout])
        else:
            opt = OnebitAdam(model.parameters(), lr=1e-2, freeze_step=1, backend=layouts[layout])
        if not states:
            for step in range(3):
                model(torch.randn(16, 8, generator=torch.Generator().manual_seed(step))).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
        states.append(opt.state_dict())
    return caught(opt.load_state_dict, states[0])


@pytest.mark.parametrize("saved_on, loaded_on", [("flat", "2x2"), ("2x2", "flat")])
@pytest.mark.parametrize("diloco", [False, True])
def test_optimizer_state_of_another_layout_is_refused_at_load(six, saved_on, loaded_on, diloco):
    """The error feedback of a flat group and of a hierarchical one over the same ranks serve other
    parts of the buckets: such a state loaded, then every rank raised at the next step. DiLoCo,
    which has no reset of its errors, is not sent to drop_error_feedback."""
    remedy = "the backend it was saved with" if diloco else "drop_error_feedback"
    for r in six.run(checkpoint_across_layouts, saved_on, loaded_on, diloco, ranks=range(4)):
        assert r is not None and r[0] == "ValueError" and remedy in r[1], r


def agreed_runtime_error() -> tuple:
    """A fresh 2x3 backend (its own groups: a failing check must not break the module's); rank 0's
    tensor is sparse, which the agreement refuses on every rank as a RuntimeError; then a good call."""
    import torch.distributed as dist

    be = compcomm.backends.get("hierarchical", local_world_size=3)
    bad = torch.ones(64).to_sparse() if dist.get_rank() == 0 else torch.ones(64)
    refused = caught(compcomm.compressed_allreduce, bad, compcomm.ErrorFeedback(), backend=be)
    return refused, caught(compcomm.compressed_allreduce, torch.ones(64), compcomm.ErrorFeedback(), backend=be)


def test_an_agreed_runtime_error_leaves_the_hierarchical_group_usable(six):
    """A review found the first version of the abandonment taking an agreed RuntimeError (every
    rank in step) for a transport failure: the group refused every later call."""
    for refused, after in six.run(agreed_runtime_error):
        assert refused is not None and refused[0] == "RuntimeError", refused
        assert after is None, after


def refused_before_any_byte_moves() -> dict:
    """A hierarchical backend of one rank per node, whose group across nodes has the world's ranks
    and so shares the world's channel: byte collectives a transport would refuse mid-call (dtypes
    gloo cannot sum, meta buffers), the bytes they counted, then good calls on it, on the world's
    gloo and a compressed call."""
    import torch.distributed as dist

    from compcomm import backends

    alone = [dist.new_group([r]) for r in range(6)]  # group creation: all six ranks
    be = backends.hierarchical(
        backends.get("gloo", group=alone[dist.get_rank()]), backends.get("gloo", group=dist.new_group(list(range(6))))
    )
    before = be.bytes_sent
    refused = [
        caught(be.all_reduce, torch.ones(8, dtype=dtype)) for dtype in (torch.int16, torch.bool, torch.complex64)
    ]
    meta = torch.zeros(4, dtype=torch.uint8, device="meta")
    refused.append(caught(be.all_gather, meta, torch.zeros(6, 4, dtype=torch.uint8, device="meta")))
    counted = be.bytes_sent - before
    t = torch.ones(16)
    compcomm.compressed_allreduce(t, compcomm.ErrorFeedback())
    world = backends.get("gloo").all_reduce(torch.ones(4))
    return {
        "refused": refused,
        "counted": counted,
        "sums": [be.all_reduce(torch.ones(4)).tolist(), world.tolist()],
        "mean": t.tolist(),
    }


def test_byte_collectives_a_transport_would_refuse_are_refused_before_any_byte_moves(six):
    """A hierarchical all_reduce of int16 (which gloo cannot sum) raised gloo's RuntimeError in
    the middle of the composite call, which the backend took for a transport failure: it broke
    both of its groups' channels, here the world's, so every later compcomm call raised. The
    backends now refuse a dtype that not every transport sums, or a buffer on a device they do
    not serve, before anything moves (TypeError / ValueError, the same on every backend), and
    count no bytes for it."""
    for res in six.run(refused_before_any_byte_moves):
        assert [kind for kind, _ in res["refused"]] == ["TypeError"] * 3 + ["ValueError"], res["refused"]
        assert res["counted"] == 0
        assert res["sums"] == [[6.0] * 4] * 2 and res["mean"] == [1.0] * 16


def made_again() -> tuple[int, bool]:
    """get('hierarchical') once more with a layout made at start-up: the torch groups it added,
    and whether its backend's groups are those of the first."""
    import torch.distributed as dist

    from compcomm import backends

    before = len(dist.distributed_c10d._world.pg_map)
    again = backends.get("hierarchical", local_world_size=3, intra="gloo")
    first = _backends["2x3"]
    return len(dist.distributed_c10d._world.pg_map) - before, (again.intra.group, again.inter.group) == (
        first.intra.group,
        first.inter.group,
    )


def test_get_hierarchical_again_takes_the_groups_it_made(six):
    """Each call made new torch groups (one per node and one per local index), which torch keeps,
    with their sockets and threads, for the life of the default group: a program that asked for
    the backend again and again ran out of file descriptors."""
    assert six.run(made_again) == [(0, True)] * 6

"""compressed_reduce_scatter on real gloo ranks (2, 3 and 4) against a float64 reference of its
numerics, uneven row lengths included; the error-feedback identity; the exact path; errors
agreed on every rank with nothing changed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import compcomm

from rankpool import caught, group
from reference import assert_close, reference_reduce_scatter

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
TOLERANCE = {"float32": 1e-5, "bfloat16": 1e-2}


def make_input(rank: int, step: int, numel: int, dtype: str = "float32", seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + rank)
    return (torch.randn(numel, generator=g) * (rank + 1) + 0.1 * step).to(DTYPES[dtype])


def _backend(world: int):
    return compcomm.backends.get("gloo", group=group(world))


def run_steps(world: int, row: int, dtype: str, op: str, steps: int) -> list[dict]:
    be = _backend(world)
    ef = compcomm.ErrorFeedback()
    records = []
    for step in range(steps):
        x = make_input(be.rank, step, world * row, dtype)
        out = torch.empty(row, dtype=x.dtype)
        kept = x.clone()
        assert compcomm.compressed_reduce_scatter(out, x, ef, backend=be, op=op) is out
        assert torch.equal(x, kept), "the input is left as it was"
        records.append(
            {
                "input": x.double().numpy(),
                "output": out.double().numpy(),
                "worker": ef.worker_error.double().numpy(),
                "server": ef.server_error,
            }
        )
    return records


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("row", [1, 5, 8, 13, 100])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("op", ["mean", "sum"])
def test_matches_reference_step_by_step(pool, world, row, dtype, op):
    steps = 3
    per_rank = pool.run(run_steps, world, row, dtype, op, steps, ranks=range(world))
    padded = -(-row // 8) * 8
    worker = np.zeros((world, world, padded))
    for step in range(steps):
        records = [per_rank[r][step] for r in range(world)]
        assert all(rec["server"] is None for rec in records), "a reduce-scatter keeps no server error"
        expected, ref_worker = reference_reduce_scatter([rec["input"] for rec in records], worker, op)
        scale = np.abs(expected).max()
        for j in range(world):
            assert_close(records[j]["output"], expected[j], rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype] * scale)
        got_worker = np.stack([rec["worker"].reshape(world, padded) for rec in records])
        assert_close(got_worker, ref_worker, rtol=1e-5, atol=1e-5 * scale)
        worker = got_worker  # next step from our state: no drift from rounding


@pytest.mark.parametrize("row", [1, 4, 5, 8, 100, 1024])
@pytest.mark.parametrize("backend", [None, "local"])
def test_a_world_of_one_matches_reference(row, backend):
    """In one process (no launcher): the lone row is this rank's, compressed and decoded."""
    ef, worker = compcomm.ErrorFeedback(), np.zeros((1, 1, -(-row // 8) * 8))
    for step in range(3):
        x, out = make_input(0, step, row), torch.empty(row)
        compcomm.compressed_reduce_scatter(out, x, ef, backend=backend)
        expected, worker = reference_reduce_scatter([x.double().numpy()], worker, "mean")
        assert_close(out.double().numpy(), expected[0], rtol=1e-5, atol=1e-6)


def identity_terms(world: int, row: int, op: str, calls: int) -> dict:
    be = _backend(world)
    ef = compcomm.ErrorFeedback()
    out_sum = torch.zeros(row, dtype=torch.float64)
    for step in range(calls):
        out = torch.empty(row)
        compcomm.compressed_reduce_scatter(out, make_input(be.rank, step, world * row, seed=7), ef, backend=be, op=op)
        out_sum += out.double()
    padded = -(-row // 8) * 8
    return {"out_sum": out_sum.numpy(), "worker": ef.worker_error.view(world, padded)[:, :row].double().numpy()}


@pytest.mark.parametrize("op", ["mean", "sum"])
def test_error_feedback_identity(pool, op):
    """Summed over calls: each owner's outputs + its share of every rank's worker error (row j,
    / n for mean) = the sum of the true reductions of row j."""
    world, row, calls = 4, 251, 6
    res = pool.run(identity_terms, world, row, op, calls)
    for j in range(world):
        exact = np.zeros(row)
        for step in range(calls):
            rows = np.stack(
                [
                    make_input(r, step, world * row, seed=7).double().numpy()[j * row : (j + 1) * row]
                    for r in range(world)
                ]
            )
            exact += rows.mean(0) if op == "mean" else rows.sum(0)
        carried = np.sum([res[r]["worker"][j] for r in range(world)], axis=0)
        carried = carried / world if op == "mean" else carried
        assert_close(res[j]["out_sum"] + carried, exact, atol=1e-4 * np.abs(exact).max())


def exact_call(world: int, row: int) -> tuple[np.ndarray, bool]:
    be = _backend(world)
    ef = compcomm.ErrorFeedback()
    x = make_input(be.rank, 0, world * row)
    out = torch.empty(row)
    compcomm.compressed_reduce_scatter(out, x, ef, backend=be, min_compress_bytes=1 << 40)
    return out.double().numpy(), ef.initialized


def test_exact_path_sums_rows_in_rank_order(pool):
    world, row = 4, 37
    res = pool.run(exact_call, world, row)
    for j in range(world):
        rows = [make_input(r, 0, world * row)[j * row : (j + 1) * row] for r in range(world)]
        total = rows[0].clone()
        for part in rows[1:]:
            total += part
        assert np.array_equal(res[j][0], (total / world).double().numpy())
        assert res[j][1] is False, "the exact path leaves the error feedback alone"


def bad_call(case: str) -> tuple[tuple[str, str] | None, bool]:
    """One bad call on rank 1 after a good one: the error every rank raised, and whether this
    rank's error state and output were left exactly as they were."""
    be = _backend(4)
    ef = compcomm.ErrorFeedback()
    compcomm.compressed_reduce_scatter(torch.empty(10), make_input(be.rank, 0, 40), ef, backend=be)
    before = ef.worker_error.clone()
    x, out = make_input(be.rank, 1, 40), torch.full((10,), 7.0)
    if be.rank == 1:
        if case == "nan":
            x[3] = float("nan")
        elif case == "indivisible":
            x = make_input(be.rank, 1, 41)
        elif case == "output":
            out = torch.empty(11)
        elif case == "numel":
            x, out = make_input(be.rank, 1, 44), torch.empty(11)
        elif case == "another-rank":  # rank 2's state_dict(), loaded on rank 1
            ef.load_state_dict({**ef.state_dict(), "rank": 2})
    failure = caught(compcomm.compressed_reduce_scatter, out, x, ef, backend=be)
    untouched = torch.equal(ef.worker_error, before) and bool((out == 7.0).all() or out.numel() != 10)
    return failure, untouched


@pytest.mark.parametrize(
    "case, error, words",
    [
        ("nan", "NonFiniteError", "rank(s) [1]"),
        ("indivisible", "ValueError", "multiple of 4"),
        ("output", "ValueError", "one row of the input"),
        ("numel", "ValueError", "40-element tensor"),
        ("another-rank", "ValueError", "errors of rank 2, not of rank 1"),
    ],
)
def test_bad_call_raises_on_every_rank_and_changes_nothing(pool, case, error, words):
    res = pool.run(bad_call, case)
    for failure, untouched in res:
        assert failure is not None and failure[0] == error and words in failure[1], failure
        assert untouched


def mixed_with_allreduce() -> tuple[str, str] | None:
    """An ErrorFeedback of an allreduce given to a reduce-scatter is refused (its errors line up
    with another layout)."""
    be = _backend(4)
    ef = compcomm.ErrorFeedback()
    compcomm.compressed_allreduce(make_input(be.rank, 0, 40), ef, backend=be)
    return caught(compcomm.compressed_reduce_scatter, torch.empty(10), make_input(be.rank, 1, 40), ef, backend=be)


def test_error_feedback_of_another_collective_is_refused(pool):
    for failure in pool.run(mixed_with_allreduce):
        assert failure is not None and failure[0] == "ValueError" and "reduce_scatter" in failure[1]


def wire_bytes(world: int, row: int) -> int:
    be = _backend(world)
    ef = compcomm.ErrorFeedback()
    out = torch.empty(row)
    compcomm.compressed_reduce_scatter(out, make_input(be.rank, 0, world * row), ef, backend=be)
    before = be.bytes_sent
    compcomm.compressed_reduce_scatter(out, make_input(be.rank, 1, world * row), ef, backend=be)
    return be.bytes_sent - before


def test_wire_bytes_are_one_bit_per_element_plus_a_scale_per_row(pool):
    """Per rank: (n-1)/n x (N/8 + 4n) bytes for the rows plus phase 0's headers; within 1.05x of
    the 1-bit ideal (n-1)/n x N/8 for a 1 MiB-sized tensor."""
    from compcomm.agreement import HEADER

    world, row = 4, 1 << 16
    sent = pool.run(wire_bytes, world, row)
    ideal = (world - 1) * (row // 8)
    assert all(s == (world - 1) * (row // 8 + 4 + HEADER.itemsize) for s in sent), sent
    assert sent[0] <= 1.05 * ideal

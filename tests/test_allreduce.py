"""compressed_allreduce on real gloo ranks against the float64 reference of SPEC section 3."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

import compcomm
from compcomm.layout import padded_size

from rankpool import group
from reference import assert_close, reference_allreduce

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
TOLERANCE = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1e-2}


def make_input(rank: int, step: int, numel: int, dtype: str, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + rank)
    return (torch.randn(numel, generator=g) * (rank + 1) + 0.1 * step).to(DTYPES[dtype])


def run_steps(world: int, numel: int, dtype: str, op: str, steps: int, shape=None) -> list[dict]:
    """On each rank of group(world): `steps` calls of `make_input`'s inputs; per step a digest of
    the output's bits, the output itself on the group's first rank (the digests show the others'
    equal) and the errors (fp32, as kept)."""
    import torch.distributed as dist

    backend = compcomm.backends.get("gloo", group=group(world))
    rank = dist.get_rank(group(world))
    ef = compcomm.ErrorFeedback()
    records = []
    for step in range(steps):
        x = make_input(rank, step, numel, dtype)
        t = x.clone().view(shape) if shape else x.clone()
        out = compcomm.compressed_allreduce(t, ef, backend=backend, op=op)
        assert out is t and t.dtype == x.dtype and t.shape == (shape or x.shape)
        bits = t.reshape(-1).view(
            torch.uint8 if t.element_size() == 1 else torch.int16 if t.element_size() == 2 else torch.int32
        )
        records.append(
            {
                "raw": hashlib.sha256(bits.numpy().tobytes()).hexdigest(),
                "output": t.reshape(-1).double().numpy() if rank == 0 else None,
                "worker": ef.worker_error.numpy().copy(),
                "server": ef.server_error.numpy().copy(),
                "server_max": ef._server_max,  # as the call recorded it, from its error update's own pass
            }
        )
    return records


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("numel", [1, 7, 100, 1000])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("op", ["mean", "sum"])
def test_matches_reference_step_by_step(pool, world, numel, dtype, op):
    steps = 3
    per_rank = pool.run(run_steps, world, numel, dtype, op, steps, ranks=range(world))
    m = padded_size(numel, world)
    worker = np.zeros((world, m))
    server = np.zeros((world, m // world))
    for step in range(steps):
        records = [per_rank[r][step] for r in range(world)]
        assert len({rec["raw"] for rec in records}) == 1, "outputs differ between ranks"
        inputs = [make_input(r, step, numel, dtype).double().numpy() for r in range(world)]
        expected, ref_worker, ref_server = reference_allreduce(inputs, worker, server, op)
        scale = np.abs(expected).max()
        assert_close(records[0]["output"], expected, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype] * scale)
        got_worker = np.stack([rec["worker"] for rec in records]).astype(np.float64)
        got_server = np.stack([rec["server"] for rec in records]).astype(np.float64)
        assert_close(got_worker, ref_worker, rtol=1e-5, atol=1e-5 * scale)
        assert_close(got_server, ref_server, rtol=1e-5, atol=1e-5 * scale)
        # the bound phase 0 sends next: max |e_s| as the update wrote it, no pass of its own
        assert [rec["server_max"] for rec in records] == [float(np.abs(s).max()) for s in got_server]
        worker, server = got_worker, got_server  # next step from our state: no drift from rounding


def identity_terms(world: int, numel: int, op: str, calls: int) -> dict:
    import torch.distributed as dist

    backend = compcomm.backends.get("gloo", group=group(world))
    rank = dist.get_rank(group(world))
    ef = compcomm.ErrorFeedback()
    out_sum = torch.zeros(numel, dtype=torch.float64)
    for step in range(calls):
        t = make_input(rank, step, numel, "float32", seed=7)
        compcomm.compressed_allreduce(t, ef, backend=backend, op=op)
        out_sum += t.double()
    return {
        "out_sum": out_sum.numpy(),
        "worker": ef.worker_error[:numel].double().numpy(),
        "server": ef.server_error.double().numpy(),
    }


@pytest.mark.parametrize("op", ["mean", "sum"])
def test_error_feedback_identity(pool, op):
    """sum of outputs + mean worker error + concatenated server errors = sum of true means."""
    world, numel, calls = 4, 1003, 6
    res = pool.run(identity_terms, world, numel, op, calls)
    exact = np.zeros(numel)
    for step in range(calls):
        stack = np.stack([make_input(r, step, numel, "float32", seed=7).double().numpy() for r in range(world)])
        exact += stack.mean(0) if op == "mean" else stack.sum(0)
    worker = np.mean([r["worker"] for r in res], axis=0) if op == "mean" else np.sum([r["worker"] for r in res], axis=0)
    server = np.concatenate([r["server"] for r in res])[:numel]
    assert_close(res[0]["out_sum"] + worker + server, exact, atol=1e-4 * np.abs(exact).max())


@pytest.mark.parametrize("numel", [5_000_001])  # the last chunk padded
def test_large_call_with_signs_split_between_phases_zero_and_one_matches_reference(pool, numel):
    """Rows wider than phase 0's room: the first call sends the rest of them in phase 1, and the
    calls after it send them during the scan (gloo, rows beyond DIRECT_GATHER_BYTES); every
    result is the reference's."""
    from compcomm.agreement import FOLD_BYTES
    from compcomm.layout import chunk_size

    assert chunk_size(numel, 4) // 8 > FOLD_BYTES // 4
    world, steps = 4, 2
    per_rank = pool.run(run_steps, world, numel, "float32", "mean", steps)
    worker = np.zeros((world, padded_size(numel, world)))
    server = np.zeros((world, padded_size(numel, world) // world))
    for step in range(steps):
        records = [per_rank[r][step] for r in range(world)]
        assert len({rec["raw"] for rec in records}) == 1, "outputs differ between ranks"
        inputs = [make_input(r, step, numel, "float32").double().numpy() for r in range(world)]
        expected, worker, server = reference_allreduce(inputs, worker, server, "mean")
        assert_close(records[0]["output"], expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
        worker = np.stack([rec["worker"] for rec in records]).astype(np.float64)
        server = np.stack([rec["server"] for rec in records]).astype(np.float64)

"""`error_feedback_out` on 4 real gloo ranks: the errors after a call written into another
ErrorFeedback, the input one left as it was. The result and the new errors are bitwise those of
the same call in place; a rejected call changes neither; bad outputs are an agreed error."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import compcomm
from compcomm import ErrorFeedback

from rankpool import caught, group

WORLD = 4


def make_input(rank: int, step: int, numel: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step * 1009 + rank)
    return torch.randn(numel, generator=g) * (rank + 1) + 0.1 * step


def snapshot(ef: ErrorFeedback) -> tuple:
    """Everything an ErrorFeedback holds, as bytes."""
    raw = tuple(None if t is None else t.numpy().tobytes() for t in (ef.worker_error, ef.server_error))
    return (*raw, ef.numel, ef.world_size, ef.tag)


def out_against_in_place(be, numel: int, steps: int, exact_from: int | None = None) -> list[dict]:
    """Per step: whether the call into `spare` left `kept` unchanged, gave the in-place call's
    result and errors, and reused spare's buffers; then the two swap, as an optimizer does.
    Steps from `exact_from` on go uncompressed (`min_compress_bytes`)."""
    kept, spare, twin = ErrorFeedback(tag="t"), ErrorFeedback(tag="t"), ErrorFeedback(tag="t")
    records = []
    for step in range(steps):
        x = make_input(be.rank, step, numel)
        a, b = x.clone(), x.clone()
        before, buffers = snapshot(kept), spare.worker_error
        min_compress_bytes = 1 << 30 if exact_from is not None and step >= exact_from else None
        compcomm.compressed_allreduce(
            a, kept, backend=be, error_feedback_out=spare, min_compress_bytes=min_compress_bytes
        )
        compcomm.compressed_allreduce(b, twin, backend=be, min_compress_bytes=min_compress_bytes)
        records.append(
            {
                "kept": snapshot(kept) == before,
                "result": torch.equal(a, b),
                "errors": snapshot(spare) == snapshot(twin),
                "reused": buffers is None or spare.worker_error is buffers,
                "output": a.numpy().tobytes(),
            }
        )
        kept, spare = spare, kept
    return records


def gloo() -> compcomm.backends.Backend:
    return compcomm.backends.get("gloo", group=group(WORLD))


def check_out_against_in_place(results: list[list[dict]]) -> None:
    for step in range(len(results[0])):
        assert len({r[step]["output"] for r in results}) == 1, "ranks differ"
        for r in results:
            assert r[step]["kept"] and r[step]["result"] and r[step]["errors"] and r[step]["reused"], (step, r[step])


def on_gloo(numel: int, steps: int, exact_from: int | None = None) -> list[dict]:
    return out_against_in_place(gloo(), numel, steps, exact_from)


@pytest.mark.parametrize("numel", [5, 1000, 70_001])
def test_into_another_error_feedback_is_the_in_place_call(pool, numel):
    check_out_against_in_place(pool.run(on_gloo, numel, 4))


def test_below_min_compress_bytes_the_output_takes_the_unchanged_errors(pool):
    """The exact path changes no error: the output gets the input's errors (a swap keeps them)."""
    results = pool.run(on_gloo, 1000, 5, 2)  # 1-bit steps leave errors, then exact steps
    check_out_against_in_place(results)


def rejected(case: str) -> tuple[tuple[str, str] | None, bool]:
    """A bad call on one rank (rank 1): the error every rank raised, and whether this rank's
    input and output ErrorFeedbacks are exactly as before."""
    be = gloo()
    kept, spare = ErrorFeedback(tag="t"), ErrorFeedback(tag="t")
    compcomm.compressed_allreduce(make_input(be.rank, 0, 100), kept, backend=be)  # errors to keep
    compcomm.compressed_allreduce(make_input(be.rank, 1, 100), spare, backend=be)
    before = snapshot(kept), snapshot(spare)
    x = make_input(be.rank, 2, 100)
    out: object = spare
    if be.rank == 1 and case == "nan":
        x[3] = math.nan
    if be.rank == 1 and case == "not an ErrorFeedback":
        out = "spare"
    if case == "output is another tensor's input":
        other = ErrorFeedback(tag="u")
        err = caught(
            compcomm.compressed_allreduce_coalesced,
            [x, x.clone()],
            [kept, other],
            backend=be,
            error_feedbacks_out=[other, spare] if be.rank == 1 else [spare, other],
        )
    elif case == "outputs counted wrong":
        err = caught(
            compcomm.compressed_allreduce_coalesced,
            [x],
            [kept],
            backend=be,
            error_feedbacks_out=[spare, ErrorFeedback()] if be.rank == 1 else [spare],
        )
    elif case == "outputs not a sequence":  # one rank passes a bare ErrorFeedback: it must not raise alone
        err = caught(
            compcomm.compressed_allreduce_coalesced,
            [x],
            [kept],
            backend=be,
            error_feedbacks_out=spare if be.rank == 1 else [spare],
        )
    elif case == "inputs not a sequence":
        err = caught(
            compcomm.compressed_allreduce_coalesced,
            [x],
            kept if be.rank == 2 else [kept],
            backend=be,
            error_feedbacks_out=[spare],
        )
    else:
        err = caught(compcomm.compressed_allreduce, x, kept, backend=be, error_feedback_out=out)
    return err, (snapshot(kept), snapshot(spare)) == before


@pytest.mark.parametrize(
    "case, error",
    [
        ("nan", "NonFiniteError"),
        ("not an ErrorFeedback", "TypeError"),
        ("output is another tensor's input", "ValueError"),
        ("outputs counted wrong", "ValueError"),
        ("outputs not a sequence", "TypeError"),
        ("inputs not a sequence", "TypeError"),
    ],
)
def test_a_rejected_call_changes_neither_on_any_rank(pool, case, error):
    results = pool.run(rejected, case)
    assert all(err is not None and err[0] == error for err, _ in results), results
    assert len({err for err, _ in results}) == 1, "ranks raised different errors"
    assert all(unchanged for _, unchanged in results)


def shallow_copied_spare() -> dict:
    """A spare made with copy.copy(kept) holds kept's own tensors: the call must not write into them."""
    be = gloo()
    kept, twin = ErrorFeedback(tag="t"), ErrorFeedback(tag="t")
    for step in range(2):  # errors to keep, in both
        for ef in (kept, twin):
            compcomm.compressed_allreduce(make_input(be.rank, step, 1000), ef, backend=be)
    spare = copy.copy(kept)
    before = snapshot(kept)
    a, b = make_input(be.rank, 2, 1000), make_input(be.rank, 2, 1000)
    compcomm.compressed_allreduce(a, kept, backend=be, error_feedback_out=spare)
    compcomm.compressed_allreduce(b, twin, backend=be)
    return {"kept": snapshot(kept) == before, "errors": snapshot(spare) == snapshot(twin), "result": torch.equal(a, b)}


def test_a_spare_sharing_the_inputs_tensors_gets_its_own(pool):
    for r in pool.run(shallow_copied_spare):
        assert r == {"kept": True, "errors": True, "result": True}, r

"""`error_feedback_out` on 4 real gloo ranks: the errors after a call written into another
ErrorFeedback, the input one left as it was. The result and the new errors are bitwise those of
the same call in place; a rejected call leaves the input as it was and the output as it was or
holding no errors; bad outputs are an agreed error. Also the worker error's two forms (in place,
with and without `double_buffer`) against each other and the float64 reference."""

from __future__ import annotations

import copy
import math
import pickle

import numpy as np
import pytest
import torch

import compcomm
from compcomm import ErrorFeedback
from compcomm.layout import padded_size

from rankpool import caught, group
from reference import assert_close, reference_allreduce

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
        before, buffers = snapshot(kept), spare.worker_form(torch.device("cpu"))[0]
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
                "reused": buffers is None or spare.worker_form(torch.device("cpu"))[0] is buffers,
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
    input ErrorFeedback is exactly as before and its output either as before or holding no
    errors (a call that has scanned writes the new worker state into the output's buffer before
    the verdict, giving up what it held: a spare's old errors, which no caller reads)."""
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
    given_up = not spare.initialized and spare.server_error is None and spare.numel is None
    return err, snapshot(kept) == before[0] and (snapshot(spare) == before[1] or given_up)


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


def two_forms(numel: int, steps: int) -> dict:
    """In-place calls from the same inputs into an ErrorFeedback kept in the x' form (never read
    between calls) and one with a single buffer (read at every step, for the reference); at
    step 2 rank 1 sends a NaN, rejected on every rank; at step 4 the x' one is checkpointed and
    restored into a new instance; at step 5 a shallow copy of it is read."""
    be = gloo()
    fast, slow = ErrorFeedback(tag="t"), ErrorFeedback(tag="t", double_buffer=False)
    records, buffers = [], []
    for step in range(steps):
        x = make_input(be.rank, step, numel)
        if step == 2:
            bad = x.clone()
            if be.rank == 1:
                bad[3] = math.nan
            for ef in (fast, slow):
                assert caught(compcomm.compressed_allreduce, bad.clone(), ef, backend=be)[0] == "NonFiniteError"
        if step == 5:  # reads change nothing, also through a shallow copy sharing the buffers
            copy.copy(fast).state_dict()
            assert fast.worker_error is not fast.worker_form(torch.device("cpu"))[0]
        if step == 4:
            restored = ErrorFeedback(tag="t")
            restored.load_state_dict(copy.deepcopy(fast.state_dict()))
            fast = restored
        a, b = x.clone(), x.clone()
        compcomm.compressed_allreduce(a, fast, backend=be)
        compcomm.compressed_allreduce(b, slow, backend=be)
        buffers.append(fast.worker_form(torch.device("cpu"))[0].data_ptr())
        records.append(
            {
                "input": x.double().numpy(),
                "same": torch.equal(a, b),
                "output": a.double().numpy(),
                "worker": slow.worker_error.double().numpy(),
                "server": slow.server_error.double().numpy(),
            }
        )
    in_turn = buffers[2:4] == buffers[0:2] and buffers[6] == buffers[4]  # the restored one from step 4
    return {"records": records, "errors": snapshot(fast) == snapshot(slow), "in_turn": in_turn}


@pytest.mark.parametrize("numel", [13, 70_001])
def test_the_x_prime_form_gives_the_single_buffer_bits_and_the_reference(pool, numel):
    """Held as (x', s) across calls, through a rejected call and a checkpoint, the worker error
    gives every output and, at the end, the errors of the single-buffer form bit for bit (reading
    it, even through a copy sharing its buffers, changes nothing), which
    follow the float64 reference; the x' form uses two buffers in turn, no more (two before the
    checkpoint, the restored instance's two after it)."""
    results = pool.run(two_forms, numel, 7)
    for r in results:
        assert r["errors"] and r["in_turn"] and all(rec["same"] for rec in r["records"])
    m = padded_size(numel, WORLD)
    worker, server = np.zeros((WORLD, m)), np.zeros((WORLD, m // WORLD))
    for step in range(7):
        records = [r["records"][step] for r in results]
        expected, ref_worker, ref_server = reference_allreduce([rec["input"] for rec in records], worker, server)
        scale = np.abs(expected).max()
        assert_close(records[0]["output"], expected, rtol=1e-5, atol=1e-5 * scale)
        got_worker = np.stack([rec["worker"] for rec in records])
        got_server = np.stack([rec["server"] for rec in records])
        assert_close(got_worker, ref_worker, rtol=1e-5, atol=1e-5 * scale)
        assert_close(got_server, ref_server, rtol=1e-5, atol=1e-5 * scale)
        worker, server = got_worker, got_server


def test_an_error_feedback_pickled_before_the_x_prime_form_loads():
    """An instance pickled when `worker_error` was a plain attribute unpickles with its errors."""
    errors = torch.arange(16, dtype=torch.float32)
    old = ErrorFeedback(tag="t")
    state = {k: v for k, v in old.__dict__.items() if k not in ("_state", "_spare", "_spare_server", "double_buffer")}
    state["worker_error"] = errors
    loaded = ErrorFeedback.__new__(ErrorFeedback)
    loaded.__setstate__(state)
    assert torch.equal(loaded.worker_error, errors) and loaded.double_buffer and loaded.tag == "t"


def test_an_error_feedback_pickled_by_0_1_0_loads_and_serves_a_call():
    """0.1.0 pickled four attributes (no tag, layout or server maximum); its errors carry on."""
    be = compcomm.backends.get("local")
    today = ErrorFeedback(tag="")
    compcomm.compressed_allreduce(torch.randn(100), today, backend=be)
    state = {key: value for key, value in today.state_dict().items()}
    loaded = ErrorFeedback.__new__(ErrorFeedback)
    loaded.__setstate__(state)
    x = torch.randn(100)
    a, b = x.clone(), x.clone()
    compcomm.compressed_allreduce(a, today, backend=be)
    compcomm.compressed_allreduce(b, loaded, backend=be)
    assert torch.equal(a, b) and torch.equal(loaded.worker_error, today.worker_error)


def test_a_pickle_or_copy_carries_no_scratch_buffer():
    ef = ErrorFeedback()
    for _ in range(2):
        compcomm.compressed_allreduce(torch.randn(100), ef, backend=compcomm.backends.get("local"))
    assert ef._spare is not None
    for twin in (pickle.loads(pickle.dumps(ef)), copy.deepcopy(ef), copy.copy(ef)):
        assert twin._spare is None and torch.equal(twin.worker_error, ef.worker_error)


@pytest.mark.parametrize("double_buffer", [True, False])
def test_nbytes_counts_the_errors_and_the_second_buffer(double_buffer):
    ef = ErrorFeedback(double_buffer=double_buffer)
    assert ef.nbytes == 0
    for _ in range(3):
        compcomm.compressed_allreduce(torch.randn(100), ef, backend=compcomm.backends.get("local"))
    m = padded_size(100, 1)
    assert ef.nbytes == 4 * (m * (2 if double_buffer else 1) + ef.server_error.numel())


@pytest.mark.parametrize("form", ["attributes", "pair"])
def test_an_x_prime_state_pickled_by_an_earlier_form_loads(form):
    """The x' form was pickled as `_worker` and `_pending_scale`, then as a (buffer, scale)
    pair; both load with the size from `numel` and carry on bit for bit."""
    be = compcomm.backends.get("local")
    today = ErrorFeedback()
    for _ in range(2):
        compcomm.compressed_allreduce(torch.randn(100), today, backend=be)
    state = today.__getstate__()
    buffer, scale, _ = state.pop("_state")
    assert scale is not None  # the x' form
    if form == "attributes":
        state.update(_worker=buffer.clone(), _pending_scale=scale)
    else:
        state["_state"] = (buffer.clone(), scale)
    loaded = ErrorFeedback.__new__(ErrorFeedback)
    loaded.__setstate__(state)
    assert torch.equal(loaded.worker_error, today.worker_error)
    x = torch.randn(100)
    a, b = x.clone(), x.clone()
    compcomm.compressed_allreduce(a, today, backend=be)
    compcomm.compressed_allreduce(b, loaded, backend=be)
    assert torch.equal(a, b)

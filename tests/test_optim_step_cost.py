"""What an optimizer step costs beyond its arithmetic, on real gloo ranks: the error feedback is
copied into a spare per bucket instead of cloned, masks touch only the masked elements, the
gradient scan is skipped only where the collective itself finds non-finite values, and the
step reports how much of its communication ran behind backward."""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from test_optim import backward, make_model, make_optimizer, rank_of, raw
from test_optim_zeroone import SCHEDULE, make_zeroone

import compcomm
from compcomm.optim import OnebitLamb, ZeroOneAdam
from compcomm.optim.timing import CommClock
from compcomm.optim.updates import mask_, sparse_mask

from rankpool import group

# ------------------------------------------------------------------ error feedback buffers


def held(ef: compcomm.ErrorFeedback) -> torch.Tensor:
    """The buffer the worker error is held in (reading `worker_error` in the x' form gives a new tensor)."""
    buffer, _ = ef.worker_form(torch.device("cpu"))
    assert buffer is not None
    return buffer


def error_buffers(name: str) -> tuple[list[set[int]], bool]:
    """Per bucket, the addresses its worker error lived at over 6 compressed steps; and whether
    the kept error feedback equals a clone-based copy at the end (bitwise)."""
    rank = rank_of(4)
    model = make_model()
    opt = make_optimizer(name, model, 4, 2)
    opt.bucket_bytes = 200
    seen: list[set[int]] = []
    for step in range(8):
        backward(model, rank, step)
        opt.step()
        if step >= 2:
            seen = seen or [set() for _ in opt.error_feedback]
            for addresses, ef in zip(seen, opt.error_feedback):
                addresses.add(held(ef).data_ptr())
    twin = compcomm.ErrorFeedback().copy_(opt.error_feedback[0])
    same = all(
        torch.equal(a, b)
        for a, b in (
            (twin.worker_error, opt.error_feedback[0].worker_error),
            (twin.server_error, opt.error_feedback[0].server_error),
        )
    )
    return seen, same and twin.tag == opt.error_feedback[0].tag


@pytest.mark.parametrize("name", ["adam", "lamb"])
def test_compressed_steps_reuse_two_error_buffers_per_bucket(pool, name):
    """A clone per step would give every step's error feedback a new address."""
    for seen, same in pool.run(error_buffers, name):
        assert len(seen) >= 3 and all(len(addresses) == 2 for addresses in seen)
        assert same


def test_error_feedback_copy_reuses_buffers_and_copies_state():
    be = compcomm.backends.get("local")
    source = compcomm.ErrorFeedback(tag="source")
    compcomm.compressed_allreduce(torch.randn(100), source, backend=be)
    target = compcomm.ErrorFeedback(tag="target")
    assert target.copy_(source) is target and target.tag == "source"
    first = held(target).data_ptr()
    compcomm.compressed_allreduce(torch.randn(100), source, backend=be)
    target.copy_(source)
    assert held(target).data_ptr() == first  # written in place the second time
    assert torch.equal(target.worker_error, source.worker_error)
    assert torch.equal(target.server_error, source.server_error)
    assert held(target).data_ptr() != held(source).data_ptr()
    assert (target.numel, target.world_size) == (source.numel, source.world_size)
    target.copy_(compcomm.ErrorFeedback(tag="empty"))
    assert not target.initialized


def test_error_feedback_copy_of_a_shallow_copy_owns_its_buffers():
    """copy.copy shares the source's tensors; copy_ must not keep writing into them."""
    source = compcomm.ErrorFeedback()
    compcomm.compressed_allreduce(torch.randn(100), source, backend=compcomm.backends.get("local"))
    twin = copy.copy(source).copy_(source)
    assert held(twin).data_ptr() != held(source).data_ptr()
    assert twin.server_error.data_ptr() != source.server_error.data_ptr()
    assert torch.equal(twin.worker_error, source.worker_error)


def in_place_calls(ef: compcomm.ErrorFeedback, seeds: list[int]) -> list[torch.Tensor]:
    be = compcomm.backends.get("local")
    outputs = []
    for seed in seeds:
        t = torch.randn(100, generator=torch.Generator().manual_seed(seed))
        compcomm.compressed_allreduce(t, ef, backend=be)
        outputs.append(t)
    return outputs


def test_copies_and_their_source_never_write_into_each_others_buffers():
    """The x' form writes each in-place call's state into a spare: a copy made with copy.copy,
    or copied into with copy_ after one, must not share it (the twin's or the source's next
    call wrote into the other's live state)."""
    source = compcomm.ErrorFeedback()
    in_place_calls(source, [0, 1])
    twin = copy.copy(source).copy_(source)
    reference = source.clone()
    assert all(torch.equal(a, b) for a, b in zip(in_place_calls(twin, [2, 3]), in_place_calls(reference, [2, 3])))
    in_place_calls(source, [4, 5])
    assert torch.equal(twin.worker_error, reference.worker_error)
    assert torch.equal(in_place_calls(twin, [6])[0], in_place_calls(reference, [6])[0])

    shallow = copy.copy(source)
    before = source.clone()
    in_place_calls(source, [7])
    in_place_calls(before, [7])
    shallow.copy_(source)
    in_place_calls(shallow, [8, 9])
    assert torch.equal(source.worker_error, before.worker_error)


def test_reading_an_output_buffer_while_calls_write_it_never_fails():
    """A reader of `worker_error` on another thread sees one call's buffer, scale and size
    together (it read the size apart, and a call giving up the output's errors left it None)."""
    import threading

    source, out = compcomm.ErrorFeedback(), compcomm.ErrorFeedback()
    in_place_calls(source, [0])
    failures: list[BaseException] = []
    done = threading.Event()

    def read() -> None:
        while not done.is_set():
            try:
                _ = out.worker_error
            except BaseException as e:  # the test reports whatever the read raised
                failures.append(e)
                return

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    reader = threading.Thread(target=read)
    reader.start()
    try:
        be = compcomm.backends.get("local")
        for seed in range(40):
            t = torch.randn(100, generator=torch.Generator().manual_seed(seed))
            compcomm.compressed_allreduce(t, source, backend=be, error_feedback_out=out)
    finally:
        done.set()
        reader.join()
        sys.setswitchinterval(interval)
    assert not failures, failures[0]


# ------------------------------------------------------------------ masks


@pytest.mark.parametrize("fraction", [0.0, 0.01, 0.5])
@pytest.mark.parametrize("into", [False, True])
@pytest.mark.parametrize("contiguous", [True, False])
@pytest.mark.parametrize("dtype, bits", [(torch.float32, torch.int32), (torch.bfloat16, torch.int16)])
def test_sparse_mask_masks_like_the_dense_one(fraction, into, contiguous, dtype, bits):
    """Bit for bit what masked_fill gives: a masked NaN or negative value becomes +0.0, a kept
    -0.0 stays -0.0."""
    g = torch.Generator().manual_seed(3)
    dense = torch.rand(64, 48, generator=g) < fraction
    values = torch.randn(64, 48, generator=g)
    values[dense & (torch.rand(64, 48, generator=g) < 0.1)] = float("nan")
    values[~dense & (torch.rand(64, 48, generator=g) < 0.05)] = -0.0
    values = values.to(dtype)
    form = sparse_mask(dense)
    assert (form is None) == (fraction == 0.0)
    assert form is None or (form.dtype == torch.int8) == (fraction == 0.5)
    for options in ({}, {"exp_avg_mask": (torch.rand(48, generator=g) > 0.2).float()}):
        expected = values.masked_fill(dense, 0.0)
        if options:
            expected.mul_(options["exp_avg_mask"])
        out = torch.empty(48, 64, dtype=dtype).t() if not contiguous else torch.empty(64, 48, dtype=dtype)
        source = values.clone()
        result = mask_(source, values, options, form, out=out if into else None)
        assert torch.equal(result.contiguous().view(bits), expected.view(bits))
        assert (result is out) if into else (result is source)


def test_mask_into_an_out_of_another_dtype_converts_first():
    values = torch.randn(32, 16, generator=torch.Generator().manual_seed(5))
    dense = torch.rand(32, 16, generator=torch.Generator().manual_seed(6)) < 0.5
    out = torch.empty(32, 16, dtype=torch.bfloat16)
    mask_(values, values, {}, sparse_mask(dense), out=out)
    assert torch.equal(out.view(torch.int16), values.to(torch.bfloat16).masked_fill(dense, 0.0).view(torch.int16))


def test_mask_refuses_a_bool_mask():
    with pytest.raises(TypeError, match="sparse_mask"):
        mask_(torch.ones(4), torch.ones(4), {}, torch.tensor([True, False, True, False]))


def zeroone_masked_nan(automatic: bool) -> tuple[bool, bool, bool]:
    """A NaN gradient on one rank, on an element that is masked (by the automatic rule or by
    exp_avg_mask), in a 1-bit step of phase 1 and in a sync of phase 2: skipped everywhere?"""
    rank = rank_of(4)
    model = make_model()
    first = model[0].weight
    if automatic:  # no gradient ever reaches column 7 of the first layer: its v is 0
        opt = make_zeroone(model)
    else:
        mask = torch.ones(16, 8)
        mask[:, 7] = 0.0
        rest = [p for n, p in model.named_parameters() if n != "0.weight"]
        opt = ZeroOneAdam(
            [{"params": [first], "exp_avg_mask": mask}, {"params": rest}],
            lr=1e-2,
            backend=compcomm.backends.get("gloo", group=group(4)),
            **SCHEDULE,
        )
    skipped = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(SCHEDULE["var_freeze_step"] + 2):
            model.zero_grad(set_to_none=True)
            g = torch.Generator().manual_seed(step * 11 + rank)
            x = torch.randn(16, 8, generator=g)
            x[:, 7] = 0.0
            torch.nn.functional.mse_loss(model(x), x[:, :4].sin()).backward()
            kind = opt._kind(opt.step_count + 1)
            test_here = (step == 2 and kind == "compressed") or step == SCHEDULE["var_freeze_step"] + 1
            if test_here and rank == 1:
                first.grad[5, 7] = math.nan
            opt.step()
            if test_here:
                skipped.append(opt.last_step_skipped)
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    return skipped == [True, True], finite, opt.skipped_steps == 2


@pytest.mark.parametrize("automatic", [True, False])
def test_zeroone_nan_on_a_masked_element_still_skips(pool, automatic):
    """0/1 Adam masks what it sends, so only its own scan sees a NaN there."""
    for result in pool.run(zeroone_masked_nan, automatic):
        assert all(result), result


@pytest.mark.parametrize("name", ["zeroone", "lamb"])
def test_freeze_step_fills_buffers_allocated_at_the_first_step(name):
    """State that the freeze fills (0/1 Adam's weights of the last sync w_s, 1-bit LAMB's fresh
    variance) lives in memory taken with the moments at step 1: a tensor allocated in the
    freeze step made that step 1.2x DDP's on 4 ranks sharing 2 cores (its pages faulted in
    there). The freeze still fills it with the weights, resp. the variance, of that step."""
    model = make_model()
    if name == "zeroone":
        opt, key, freeze = ZeroOneAdam(model.parameters(), backend="local", **SCHEDULE), "sync_weight", 12
    else:
        opt, key, freeze = OnebitLamb(model.parameters(), backend="local", freeze_step=4), "exp_avg_sq_fresh", 4
    backward(model, 0, 0)
    opt.step()
    held = {id(p): opt.state[p][key].data_ptr() for p in model.parameters()}
    for step in range(1, freeze):
        backward(model, 0, step)
        opt.step()
    for p in model.parameters():
        state = opt.state[p]
        assert state[key].data_ptr() == held[id(p)]
        assert torch.equal(state[key], p.detach() if name == "zeroone" else state["exp_avg_sq"])


# ------------------------------------------------------------------ communication behind backward


def test_comm_clock_counts_busy_and_hidden_time():
    clock = CommClock(submitted=[0.0, 1.0, 5.0], completed={0: 2.0, 1: 3.0, 2: 6.0}, backward_end=2.5)
    timing = clock.timing()
    # busy: [0, 2] + [2, 3] (queued behind the first) + [5, 6]; hidden: [0, 2] + [2, 2.5]
    assert timing.busy == pytest.approx(4.0) and timing.hidden == pytest.approx(2.5)
    assert timing.hidden_fraction == pytest.approx(2.5 / 4.0)
    assert CommClock().timing().hidden_fraction == 0.0


def timings(name: str, overlap: bool) -> tuple[list[tuple[float, float]], bytes]:
    rank = rank_of(4)
    model = make_model()
    opt = make_optimizer(name, model, 4, 3)
    opt.bucket_bytes = 200
    opt.overlap = overlap
    out = []
    for step in range(6):
        backward(model, rank, step)
        opt.step()
        assert opt.last_comm_timing is not None
        out.append((opt.last_comm_timing.busy, opt.last_comm_timing.hidden))
    return out, raw(model)


@pytest.mark.parametrize("name", ["adam", "lamb"])
def test_last_comm_timing_reports_time_hidden_behind_backward(pool, name):
    overlapped = pool.run(timings, name, True)
    plain = pool.run(timings, name, False)
    for (with_overlap, a), (without, b) in zip(overlapped, plain):
        assert a == b
        assert all(busy > 0 and 0 <= hidden <= busy for busy, hidden in with_overlap)
        assert all(hidden == 0 for _, hidden in without)  # every collective starts in step()
        # from the second step on, every bucket is submitted during backward: some time hides
        assert all(hidden > 0 for _, hidden in with_overlap[1:])


def test_optim_overlap_bench_reports_the_hidden_fraction(tmp_path):
    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "overlap.json"
    cmd = [
        sys.executable,
        str(root / "bench" / "optim_overlap.py"),
        "--world-size",
        "2",
        "--layers",
        "2",
        "--width",
        "64",
        "--batch",
        "8",
        "--steps",
        "2",
        "--bucket-mb",
        "0.01",
        "--json",
        str(out),
    ]
    proc = subprocess.run(
        cmd, cwd=root, capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "comm hidden behind backward" in proc.stdout
    records = json.loads(out.read_text())
    assert [r["stage"] for r in records] == ["warmup", "compressed"]
    for r in records:
        assert r["bitwise_equal_all_ranks"]  # parameters, with and without overlap, on every rank
        assert r["comm_hidden_fraction_no_overlap"] == 0.0
        assert 0 < r["comm_hidden_fraction_overlap"] <= 1

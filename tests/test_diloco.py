"""compcomm.optim.DiLoCo on real gloo ranks: the outer step and the streaming fragments against a
float64 reference, identity across ranks, checkpoints, GradScaler, non-finite values, equalized
starts and argument errors."""

from __future__ import annotations

import copy
import io
import math
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from test_optim import backward, batch, make_model, rank_of, raw

import compcomm
from compcomm.layout import padded_size
from compcomm.optim import DiLoCo, OnebitAdam
from compcomm.optim.replicas import equalize_from_rank0

from rankpool import caught, group
from reference import reference_allreduce, reference_rotation

WORLD = 4
INNER_LR = 0.1
OUTER = dict(outer_lr=0.7, outer_momentum=0.9, nesterov=True)
SIZES = (24, 40)  # two parameters; bucket_bytes=128 puts each in a bucket of its own


# ------------------------------------------------------------------ helpers run inside ranks


def gloo(world: int = WORLD) -> compcomm.backends.Backend:
    return compcomm.backends.get("gloo", group=group(world))


def synthetic_grad(rank: int, step: int, numel: int) -> torch.Tensor:
    """Rank `rank`'s gradient at step `step`: independent of the parameters, so that the inner
    SGD trajectory is linear and a float64 reference can follow it exactly."""
    return torch.randn(numel, generator=torch.Generator().manual_seed(7919 * step + 31 * rank + numel))


def initial(numel: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(numel))


def vector_run(
    steps: int,
    compress: bool,
    fragments: int,
    sync_every: int,
    overlap: int | None,
    bucket_bytes: int = 128,
    passes: int = 1,
    passes_until: int | None = None,
    rotate: bool = False,
) -> dict:
    """Inner SGD on synthetic gradients; after every step: the parameters, theta and the bytes
    this rank sent (the collectives in flight waited for, not applied)."""
    rank = rank_of(WORLD)
    params = [torch.nn.Parameter(initial(n)) for n in SIZES]
    inner = torch.optim.SGD(params, lr=INNER_LR)
    be = gloo()
    opt = DiLoCo(
        params,
        inner,
        sync_every=sync_every,
        compress=compress,
        fragments=fragments,
        backend=be,
        overlap_steps=overlap,
        bucket_bytes=bucket_bytes,
        **OUTER,
        passes=passes,
        passes_until=passes_until,
        rotate=rotate,
    )
    out: dict[str, list] = {"params": [], "theta": [], "bytes": [], "errors": []}
    for t in range(1, steps + 1):
        sent = be.bytes_sent
        for p in params:
            p.grad = synthetic_grad(rank, t, p.numel())
        opt.step()
        opt._sync.wait_all()
        out["bytes"].append(be.bytes_sent - sent)
        out["params"].append([p.detach().double().numpy().copy() for p in params])
        out["theta"].append(b"".join(raw_tensor(g) for g in opt.global_parameters()))
        out["errors"].append(
            [None if ef.worker_error is None else ef.worker_error.numpy().copy() for ef in opt.error_feedback]
        )
    opt.sync()
    out["after_sync"] = b"".join(raw_tensor(p) for p in params)
    out["theta_after_sync"] = b"".join(raw_tensor(g) for g in opt.global_parameters())
    out["buckets"] = len(opt.error_feedback)
    return out


def raw_tensor(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().view(torch.uint8).numpy().tobytes()


# ------------------------------------------------------------------ float64 reference


class Reference:
    """DiLoCo written out in float64 for all ranks at once: inner SGD on the synthetic gradients,
    per fragment the pseudo-gradient mean (exact, or SPEC's 1-bit allreduce with error feedback,
    of the rotated pseudo-gradients with `rotate`, rotated back), the outer Nesterov SGD and the
    mix w <- theta + (w - w_sent)."""

    def __init__(
        self,
        compress: bool,
        fragments: list[list[int]],
        offsets: list[int],
        sync_every: int,
        overlap: int,
        passes: int = 1,
        passes_until: int | None = None,
        rotate: bool = False,
    ):
        self.compress, self.fragments, self.offsets, self.rotate = compress, fragments, offsets, rotate
        self.passes, self.passes_until = passes, passes_until
        self.sync_every, self.overlap = sync_every, overlap
        self.w = [[initial(n).double().numpy() for n in SIZES] for _ in range(WORLD)]
        self.theta = [x.copy() for x in self.w[0]]
        self.momentum: dict[int, list[np.ndarray]] = {}
        self.errors = {}
        for f, params in enumerate(fragments):
            numel = sum(SIZES[i] for i in params)
            m = padded_size(numel, WORLD)
            self.errors[f] = (np.zeros((WORLD, m)), np.zeros((WORLD, m // WORLD)))
        self.in_flight: dict[int, tuple[int, list[np.ndarray], list[list[np.ndarray]]]] = {}

    def step(self, s: int) -> None:
        for r in range(WORLD):
            for i, n in enumerate(SIZES):
                self.w[r][i] = self.w[r][i] - INNER_LR * synthetic_grad(r, s, n).double().numpy()
        for f in sorted(self.in_flight):
            apply_at, mean, sent = self.in_flight[f]
            if apply_at == s:
                del self.in_flight[f]
                self.land(f, mean, sent)
        for f, offset in enumerate(self.offsets):
            if s % self.sync_every == offset:
                self.send(f, s)
                if self.overlap == 0:
                    self.land(f, *self.in_flight.pop(f)[1:])

    def send(self, f: int, s: int) -> None:
        params = self.fragments[f]
        sent = [[self.w[r][i].copy() for i in params] for r in range(WORLD)]
        deltas = [np.concatenate([self.theta[i] - x for i, x in zip(params, sent[r])]) for r in range(WORLD)]
        if self.compress:  # one bucket per fragment in these tests: the rotation is the bucket's
            worker, server = self.errors[f]
            r = reference_rotation(deltas[0].size) if self.rotate else np.eye(deltas[0].size)
            deltas = [r @ d for d in deltas]
            flat, worker, server = reference_allreduce(deltas, worker, server)
            calls = self.passes if self.passes_until is None or s <= self.passes_until else 1
            for _ in range(calls - 1):  # each later call reduces zeros: the errors left so far
                rest, worker, server = reference_allreduce([np.zeros_like(d) for d in deltas], worker, server)
                flat = flat + rest
            self.errors[f] = (worker, server)
            flat = r.T @ flat
        else:
            flat = sum(deltas) / WORLD
        pieces = np.split(flat, np.cumsum([SIZES[i] for i in params])[:-1])
        self.in_flight[f] = (s + self.overlap, pieces, sent)

    def land(self, f: int, mean: list[np.ndarray], sent: list[list[np.ndarray]]) -> None:
        mu, lr = OUTER["outer_momentum"], OUTER["outer_lr"]
        first = f not in self.momentum
        self.momentum[f] = [d.copy() if first else mu * m + d for d, m in zip(mean, self.momentum.get(f, mean))]
        for k, i in enumerate(self.fragments[f]):
            self.theta[i] = self.theta[i] - lr * (mean[k] + mu * self.momentum[f][k])
            for r in range(WORLD):
                self.w[r][i] = self.theta[i] + (self.w[r][i] - sent[r][k])


def relative(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def reference_step(ref: Reference, per_rank: list[dict], t: int) -> float:
    """Step t of the reference; the largest relative error of any rank's parameters after it."""
    ref.step(t)
    return max(
        relative(got, want) for r, run in enumerate(per_rank) for got, want in zip(run["params"][t - 1], ref.w[r])
    )


# ------------------------------------------------------------------ the outer step


def first_step_without_backward(late: int, poisoned: bool) -> dict:
    """Rank `late` has no batch at its first step (its step() counts all the same); both ranks
    average a logged value with their own all_reduce after every step, and sync every 3."""
    import torch.distributed as dist

    rank = rank_of(2)
    model = make_model()
    opt = DiLoCo(model.parameters(), torch.optim.SGD(model.parameters(), lr=0.05), sync_every=3, backend=gloo(2))
    logged = []
    for step in range(6):
        model.zero_grad(set_to_none=True)
        if poisoned and step == 0 and rank != late:  # NaN gradients at the end of the first backward
            x, y = batch(rank, step)
            (torch.nn.functional.mse_loss(model(x), y) * float("nan")).backward()
        elif not (rank == late and step == 0):
            backward(model, rank, step)
        opt.step()
        value = torch.tensor([float(step + rank)])
        dist.all_reduce(value, group=group(2))
        logged.append(float(value))
    return {"logged": logged, "params": raw(model), "skipped": opt.skipped_steps}


@pytest.mark.parametrize("late, poisoned", [(1, False), (0, False), (1, True)])
def test_a_rank_whose_first_step_has_no_backward_runs_in_step_with_the_others(pool, late, poisoned):
    """DiLoCo agrees on non-finite gradients at the end of the run's first backward (it cannot
    know yet whether a GradScaler is in use): a rank that steps before its first backward takes
    part in that agreement at the step. It used to wait for it in its first backward, while the
    others waited for it in their own collectives: a deadlock."""
    res = pool.run(first_step_without_backward, late, poisoned, ranks=[0, 1])
    assert [r["logged"] for r in res] == [[2.0 * s + 1 for s in range(6)]] * 2
    assert res[0]["params"] == res[1]["params"]
    assert res[0]["skipped"] == int(poisoned)  # rank 0's NaN: its first inner step skipped (rank 1 had no gradient)


@pytest.mark.parametrize("compress", [False, True])
def test_outer_step_matches_float64_reference_and_ranks_agree_bitwise(pool, compress):
    steps, h = 9, 3  # three syncs, every parameter in one fragment
    per_rank = pool.run(vector_run, steps, compress, 1, h, None, 1 << 20)
    ref = Reference(compress, [[0, 1]], [0], h, 0)
    worst = 0.0
    for t in range(1, steps + 1):
        worst = max(worst, reference_step(ref, per_rank, t))
        flat = [np.concatenate(run["params"][t - 1]).tobytes() for run in per_rank]
        assert (len(set(flat)) == 1) == (t % h == 0), f"step {t}: ranks equal exactly at syncs"
        assert len({run["theta"][t - 1] for run in per_rank}) == 1
        if compress and t % h == 0:
            for r, run in enumerate(per_rank):
                assert relative(run["errors"][t - 1][0][: sum(SIZES)], ref.errors[0][0][r][: sum(SIZES)]) < 1e-4
    assert worst < (1e-5 if compress else 1e-6), worst
    assert per_rank[0]["buckets"] == 1
    assert len({run["after_sync"] for run in per_rank}) == 1


@pytest.mark.parametrize("passes_until", [None, 6])
def test_syncs_in_several_passes_match_float64_reference(pool, passes_until):
    """passes=2: each sync reduces the pseudo-gradient, then the errors that call left, and
    adds the two means; with passes_until=6 the syncs after step 6 take one call again."""
    steps, h = 12, 3
    per_rank = pool.run(vector_run, steps, True, 1, h, None, 1 << 20, 2, passes_until)
    ref = Reference(True, [[0, 1]], [0], h, 0, passes=2, passes_until=passes_until)
    worst = 0.0
    for t in range(1, steps + 1):
        worst = max(worst, reference_step(ref, per_rank, t))
        assert len({run["theta"][t - 1] for run in per_rank}) == 1
    assert worst < 1e-5, worst
    for r, run in enumerate(per_rank):
        assert relative(run["errors"][-1][0][: sum(SIZES)], ref.errors[0][0][r][: sum(SIZES)]) < 1e-4
    assert 0 < per_rank[0]["bytes"][0] < 64  # step 1: the first backward's agreement (no backward came before)
    sent = [b for b in per_rank[0]["bytes"][1:] if b]
    if passes_until is None:
        assert len(set(sent)) == 1
    else:  # syncs at steps 3 and 6 in two calls, 9 and 12 in one (the same call's bytes again)
        assert sent[0] == sent[1] and sent[2] == sent[3] and sent[0] > sent[2]


@pytest.mark.parametrize("fragments", [1, 2])
def test_rotated_syncs_match_float64_reference(pool, fragments):
    """rotate=True: each bucket's pseudo-gradients rotated (one bucket of 64 elements, or two of
    24 and 40, each through its three windows), reduced in 1 bit with its error feedback, in two
    calls until step 6, and rotated back; the error feedback held in the rotated coordinates."""
    steps, h = 12, 4
    if fragments == 1:
        per_rank = pool.run(vector_run, steps, True, 1, h, None, 1 << 20, 2, 6, True)
        ref = Reference(True, [[0, 1]], [0], h, 0, passes=2, passes_until=6, rotate=True)
    else:
        per_rank = pool.run(vector_run, steps, True, 2, h, 1, 128, 2, 6, True)
        ref = Reference(True, [[0], [1]], [2, 0], h, 1, passes=2, passes_until=6, rotate=True)
    worst = 0.0
    for t in range(1, steps + 1):
        worst = max(worst, reference_step(ref, per_rank, t))
        assert len({run["theta"][t - 1] for run in per_rank}) == 1
    assert worst < 1e-5, worst
    for f in range(fragments):
        size = sum(SIZES[i] for i in ref.fragments[f])
        for r, run in enumerate(per_rank):
            assert relative(run["errors"][-1][f][:size], ref.errors[f][0][r][:size]) < 1e-4
    assert len({run["after_sync"] for run in per_rank}) == 1


def huge_rotated_pseudo_gradient(k: int) -> tuple[int, bool, bytes]:
    """rotate=True; before the sync after step 6, k elements of the first parameter are -0.4 *
    fp32 max on every rank (a mean, and an outer step of it, that fit fp32; the plain Hadamard
    sums of four such elements would not): skipped syncs, whether theta is finite, theta."""
    rank = rank_of(WORLD)
    params = [torch.nn.Parameter(initial(n)) for n in SIZES]
    opt = DiLoCo(params, torch.optim.SGD(params, lr=INNER_LR), 3, backend=gloo(), rotate=True, **OUTER)
    for t in range(1, 7):
        for p in params:
            p.grad = synthetic_grad(rank, t, p.numel())
        if t == 6:
            with torch.no_grad():
                params[0][:k] = -0.4 * torch.finfo(torch.float32).max
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt.step()
    theta = torch.cat([g.flatten() for g in opt.global_parameters()])
    return opt.skipped_syncs, bool(torch.isfinite(theta).all()), raw_tensor(theta)


@pytest.mark.parametrize("k", [1, 4])
def test_rotation_of_a_huge_finite_pseudo_gradient_neither_overflows_nor_refuses(pool, k):
    """The Hadamard stages halve as they go: their sums never exceed the largest input, so a
    pseudo-gradient whose unrotated sync is taken is taken rotated too, with a finite theta."""
    results = pool.run(huge_rotated_pseudo_gradient, k)
    assert len({theta for _, _, theta in results}) == 1
    for skipped, finite, _ in results:
        assert skipped == 0 and finite


def error_bytes(opt: DiLoCo) -> bytes:
    """Every bucket's worker and server errors (none before a compressed sync)."""
    held = [t for ef in opt.error_feedback for t in (ef.worker_error, ef.server_error) if t is not None]
    return b"".join(raw_tensor(t) for t in held)


def outer_bytes(opt: DiLoCo) -> bytes:
    """theta and the outer momentum."""
    momenta = [opt.outer.state[t].get("momentum_buffer") for t in opt._sync.theta]
    return b"".join(raw_tensor(t) for t in [*opt.global_parameters(), *(m for m in momenta if m is not None)])


def second_sync(params: list[torch.nn.Parameter], opt: DiLoCo, move: Callable[[], None]) -> dict:
    """Six steps on the synthetic gradients (syncs after steps 3 and 6, H = 3), `move()` changing
    the parameters just before the second sync: whether it was skipped and changed nothing."""
    rank = rank_of(WORLD)
    for t in range(1, 7):
        for p in params:
            p.grad = synthetic_grad(rank, t, p.numel())
        if t == 6:
            with torch.no_grad():
                move()
            errors, outer = error_bytes(opt), outer_bytes(opt)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt.step()
    return {
        "skipped_syncs": opt.skipped_syncs,
        "errors_unchanged": errors == error_bytes(opt),
        "outer_unchanged": outer == outer_bytes(opt),
        "finite": all(bool(torch.isfinite(g).all()) for g in [*opt.global_parameters(), *params]),
        "params": b"".join(raw_tensor(p) for p in params),
    }


def huge_pseudo_gradient(passes: int) -> dict:
    """Before the sync after step 6, 4 of the first parameter's elements are -0.95 * fp32 max on
    every rank: the first call's bound still fits fp32, but the worker error it leaves would make
    a second call's overflow."""
    params = [torch.nn.Parameter(initial(n)) for n in SIZES]
    opt = DiLoCo(params, torch.optim.SGD(params, lr=INNER_LR), 3, backend=gloo(), passes=passes, **OUTER)
    return second_sync(params, opt, lambda: params[0][:4].fill_(-0.95 * torch.finfo(torch.float32).max))


def test_a_refused_later_pass_leaves_the_error_feedback_as_it_was(pool):
    """passes=1 takes that sync; with passes=2 the second call is refused on every rank and the
    sync is skipped with nothing changed, though the first call had passed."""
    for res in pool.run(huge_pseudo_gradient, 1):
        assert res["skipped_syncs"] == 0 and not res["outer_unchanged"]
    for res in pool.run(huge_pseudo_gradient, 2):
        assert res["skipped_syncs"] == 1 and res["outer_unchanged"] and res["errors_unchanged"]


def overflowing_outer_step(compress: bool, passes: int, rotate: bool) -> dict:
    """Every parameter starts at -0.97 * fp32 max; before the sync after step 6 every rank's are
    moved to -0.999 * fp32 max: a pseudo-gradient of 0.029 * fp32 max, whose mean fp32 holds
    (the ranks' bounds sum to a ninth of its top) but whose outer Nesterov step (lr 0.7, momentum
    0.9: theta - 1.33 D) would take theta past it, to -inf."""
    top = torch.finfo(torch.float32).max
    params = [torch.nn.Parameter(torch.full((n,), -0.97 * top)) for n in SIZES]
    inner = torch.optim.SGD(params, lr=INNER_LR)
    opt = DiLoCo(params, inner, 3, backend=gloo(), compress=compress, passes=passes, rotate=rotate, **OUTER)
    return second_sync(params, opt, lambda: [p.fill_(-0.999 * top) for p in params])


@pytest.mark.parametrize(
    "compress, passes, rotate", [(False, 1, False), (True, 1, False), (True, 2, False), (True, 1, True)]
)
def test_a_mean_whose_outer_step_would_overflow_skips_the_sync_everywhere(pool, compress, passes, rotate):
    """The collective refuses a mean beyond what the outer step takes (`OuterSync.step_limit`),
    alike on every rank, so theta stays finite and nothing changes: theta, the outer momentum,
    the error feedback; the parameters go back to theta on every rank."""
    results = pool.run(overflowing_outer_step, compress, passes, rotate)
    assert len({res["params"] for res in results}) == 1
    for res in results:
        assert res["finite"]
        assert res["skipped_syncs"] == 1 and res["outer_unchanged"] and res["errors_unchanged"]


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("momentum, dampening, weight_decay", [(0.9, 0.0, 0.0), (0.5, 0.3, 0.1), (0.0, 0.0, 0.2)])
@pytest.mark.parametrize("lr", [0.7, 3.0])
def test_the_outer_steps_limit_bounds_torchs_sgd_step(nesterov, momentum, dampening, weight_decay, lr):
    """A mean just inside `step_limit`, every sign pushing theta outwards, leaves torch.optim.SGD's
    outer step finite (its second step, with a momentum buffer). Without weight decay and
    dampening every term of the bound is met with equality, and 1.1x the limit overflows: the
    limit is tight there."""
    if nesterov and momentum == 0.0:
        pytest.skip("torch refuses Nesterov without momentum")
    top = torch.finfo(torch.float32).max
    param = torch.nn.Parameter(torch.zeros(8))
    opt = DiLoCo([param], torch.optim.SGD([param], lr=0.1), backend="local")
    opt.outer.param_groups[0].update(
        lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov
    )
    theta = opt._sync.theta[0]
    outwards = torch.tensor([1.0, -1.0] * 4)  # a gradient of these signs moves theta away from 0
    theta.copy_(-0.5 * top * outwards)
    theta.grad = 1e36 * outwards
    opt.outer.step()  # the first step: the momentum buffer is this gradient
    limit = opt._sync.step_limit(0)
    assert 0.0 < limit < top
    tight = weight_decay == 0.0 and dampening == 0.0
    for scale, finite in [(1.0 - 2.0**-20, True)] + [(1.1, False)] * tight:
        trial = copy.deepcopy(opt.outer)
        moved = trial.param_groups[0]["params"][0]
        moved.grad = scale * limit * outwards
        trial.step()
        assert bool(torch.isfinite(moved).all()) == finite, scale


# ------------------------------------------------------------------ streaming fragments


@pytest.mark.parametrize("passes", [1, 2])
def test_fragments_are_staggered_and_mix_on_arrival_as_documented(pool, passes):
    steps, h, overlap = 13, 4, 1
    per_rank = pool.run(vector_run, steps, True, 2, h, overlap, 128, passes)
    ref = Reference(True, [[0], [1]], [2, 0], h, overlap, passes=passes)
    worst = 0.0
    for t in range(1, steps + 1):
        worst = max(worst, reference_step(ref, per_rank, t))
        assert len({run["theta"][t - 1] for run in per_rank}) == 1
        if t > 1:  # step 1 sends the first backward's agreement (8 bytes), made at the step with no backward
            assert (per_rank[0]["bytes"][t - 1] > 0) == (t % 2 == 0), f"step {t}: one fragment every H/K = 2 steps"
    assert worst < 1e-5, worst
    assert per_rank[0]["buckets"] == 2
    assert len({run["after_sync"] for run in per_rank}) == 1, "sync() leaves every rank on theta"


def peak_bytes(fragments: int, compress: bool) -> list[int]:
    """Bytes sent at each of 16 steps, H = 8, four equal buckets."""
    rank = rank_of(WORLD)
    params = [torch.nn.Parameter(torch.zeros(8192)) for _ in range(4)]
    be = gloo()
    opt = DiLoCo(
        params,
        torch.optim.SGD(params, lr=0.1),
        8,
        fragments=fragments,
        compress=compress,
        backend=be,
        bucket_bytes=1024,
    )
    per_step = []
    for t in range(1, 17):
        sent = be.bytes_sent
        for p in params:
            p.grad = synthetic_grad(rank, t, p.numel())
        opt.step()
        opt._sync.wait_all()
        per_step.append(be.bytes_sent - sent)
    return per_step


@pytest.mark.parametrize("compress", [False, True])
def test_fragments_cut_the_peak_bytes_per_step(pool, compress):
    whole = pool.run(peak_bytes, 1, compress)[0]
    streamed = pool.run(peak_bytes, 4, compress)[0]
    # Step 1 sends the first backward's agreement (8 bytes), made at the step where no backward came before.
    assert [t for t, b in enumerate(whole, 1) if b] == [1, 8, 16] and whole[0] < 64
    assert [t for t, b in enumerate(streamed, 1) if b] == [1, 2, 4, 6, 8, 10, 12, 14, 16] and streamed[0] < 64
    # Over the second round only: phase 0's first call on a group sizes its slots by the calls
    # made before it (here another test's), the later ones by their own.
    whole, streamed = whole[8:], streamed[8:]
    assert max(whole) / max(streamed) > 3.9
    assert sum(streamed) == pytest.approx(sum(whole), rel=0.01)


# ------------------------------------------------------------------ checkpoints


def make_diloco(model: torch.nn.Module, world: int = WORLD, **kw) -> DiLoCo:
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    kw = dict(dict(sync_every=4, fragments=2, overlap_steps=2, bucket_bytes=200), **kw)
    return DiLoCo(model.parameters(), inner, backend=gloo(world), **kw)


def trained(steps: int, **kw) -> tuple[torch.nn.Module, DiLoCo]:
    """A model and its DiLoCo after `steps` steps, each rank on its own batches."""
    rank = rank_of(WORLD)
    model = make_model()
    opt = make_diloco(model, **kw)
    for step in range(steps):
        backward(model, rank, step)
        opt.step()
    return model, opt


def state_bytes(model: torch.nn.Module, opt: DiLoCo) -> tuple[bytes, bytes, bytes]:
    """Parameters, theta and errors, once the collectives in flight have ended (not applied):
    read earlier, the errors of a fragment still in flight are being written meanwhile."""
    opt._sync.wait_all()
    theta = b"".join(raw_tensor(g) for g in opt.global_parameters())
    errors = b"|".join(
        raw_tensor(ef.worker_error) + raw_tensor(ef.server_error) for ef in opt.error_feedback if ef.initialized
    )
    return raw(model), theta, errors


def from_rank0(obj):
    """Rank 0's `obj` on every rank, through a file's bytes (what a shared checkpoint file gives)."""
    import torch.distributed as dist

    buf = io.BytesIO()
    torch.save(obj, buf)
    blob = [buf.getvalue()]
    dist.broadcast_object_list(blob, src=0, group=group(WORLD))
    return torch.load(io.BytesIO(blob[0]), weights_only=False)


def straight_vs_resumed(form: str, steps: int, stop: int, rotate: bool = False) -> tuple:
    """The state after `steps` steps: straight, with a checkpoint taken after `stop` steps (the
    live run going on), and resumed from that checkpoint in a fresh model and optimizer."""
    rank, kw = rank_of(WORLD), dict(rotate=rotate)
    straight = state_bytes(*trained(steps, **kw))

    model = make_model()
    opt = make_diloco(model, **kw)
    for step in range(steps):
        backward(model, rank, step)
        opt.step()
        if step + 1 == stop:
            in_flight = sorted(opt._sync.in_flight)
            if form == "gathered":
                saved = from_rank0(opt.gathered_state_dict())
            else:
                buf = io.BytesIO()
                torch.save(opt.state_dict(), buf)
                saved = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
    went_on = state_bytes(model, opt)

    model = make_model()
    opt = make_diloco(model, **kw)
    opt.load_state_dict(saved)
    assert opt.step_count == stop
    for step in range(stop, steps):
        backward(model, rank, step)
        opt.step()
    return straight, went_on, state_bytes(model, opt), in_flight


@pytest.mark.parametrize("form,rotate", [("per_rank", False), ("gathered", False), ("per_rank", True)])
def test_checkpoint_mid_flight_resumes_bit_for_bit(pool, form, rotate):
    """rotate=True: the mean in flight is kept rotated back once, and landed as it is."""
    for straight, went_on, resumed, in_flight in pool.run(straight_vs_resumed, form, 14, 7, rotate):
        assert in_flight == [0], "a fragment is in flight when the checkpoint is taken"
        assert straight == went_on, "saving changed the live run"
        assert straight == resumed


def wrong_checkpoints() -> list:
    model, opt = trained(5)
    rank0 = from_rank0(opt.state_dict())  # waits for the fragment in flight
    before = state_bytes(model, opt)
    failures = [caught(opt.load_state_dict, rank0)]
    other = make_diloco(make_model(), sync_every=5)
    failures.append(caught(other.load_state_dict, opt.state_dict()))
    failures.append(caught(opt.load_state_dict, {"state": {}}))
    assert state_bytes(model, opt) == before, "a refused load changed nothing"
    return failures


def test_wrong_checkpoint_raises_the_same_error_on_every_rank(pool):
    results = pool.run(wrong_checkpoints)
    for rank0, schedule, alien in results:
        assert rank0 is not None and rank0[0] == "ValueError"
        assert "rank(s) [1, 2, 3]" in rank0[1] and "gathered_state_dict" in rank0[1]
        assert schedule is not None and schedule[0] == "ValueError" and "schedule" in schedule[1]
        assert alien is not None and alien[0] == "ValueError" and "not a DiLoCo state dict" in alien[1]


def refused_loads() -> dict:
    """Loads refused on every rank before anything changes: rank 1's error feedback holds a NaN
    (the others' are fine); a model of the same sizes but other shapes; per-rank files of
    different saves (rank 2's an earlier step's)."""
    rank = rank_of(WORLD)
    model, opt = trained(6)
    earlier = opt.state_dict()
    model, opt = trained(9)
    mine = opt.state_dict()
    before = state_bytes(model, opt)
    corrupt = copy.deepcopy(mine)
    if rank == 1:
        corrupt["compcomm"]["error_feedback"][0]["worker_error"][0] = float("nan")
    out = {"corrupt": caught(opt.load_state_dict, corrupt)}
    out["corrupt_kept"] = state_bytes(model, opt) == before
    reshaped = copy.deepcopy(mine)  # the first Linear's (16, 8) weight saved as (8, 16)
    reshaped["compcomm"]["rank_local"]["params"][0] = reshaped["compcomm"]["rank_local"]["params"][0].reshape(8, 16)
    out["reshaped"] = caught(opt.load_state_dict, reshaped)
    out["reshaped_kept"] = state_bytes(model, opt) == before
    out["stale"] = caught(opt.load_state_dict, earlier if rank == 2 else mine)
    out["stale_kept"] = state_bytes(model, opt) == before
    partial = copy.deepcopy(mine)  # rank 1's file lacks its local part: a KeyError there alone, the others hung
    if rank == 1:
        del partial["compcomm"]["rank_local"]
    out["partial"] = caught(opt.load_state_dict, partial)
    counts = copy.deepcopy(mine)  # a KeyError on rank 1 after the agreement, with the rest loaded
    if rank == 1:
        del counts["compcomm"]["rank_local"]["skipped_steps"]
    out["counts"] = caught(opt.load_state_dict, counts)
    out["counts_kept"] = state_bytes(model, opt) == before
    inner = opt.inner.state_dict()
    other_inner = copy.deepcopy(mine)  # an SGD's state for the AdamW: params and theta were loaded, then KeyError
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9).state_dict()
    sgd["state"] = {0: {"momentum_buffer": torch.zeros_like(next(model.parameters()))}}
    other_inner["compcomm"]["rank_local"]["inner"] = sgd
    out["other_inner"] = caught(opt.load_state_dict, other_inner)
    out["other_kept"] = state_bytes(model, opt) == before and repr(opt.inner.state_dict()) == repr(inner)
    return out


def test_loads_refused_on_every_rank_change_nothing(pool):
    results = pool.run(refused_loads)
    for res in results:
        assert res["corrupt"][0] == "ValueError" and "rank 1: bucket 0's error feedback" in res["corrupt"][1]
        assert res["reshaped"][0] == "ValueError" and "shapes" in res["reshaped"][1]
        assert res["stale"][0] == "ValueError" and "different saves" in res["stale"][1]
        assert res["corrupt_kept"] and res["reshaped_kept"] and res["stale_kept"]
        assert res["partial"][0] == "ValueError" and "rank 1: a malformed DiLoCo state dict" in res["partial"][1]
        assert res["other_inner"][0] == "ValueError" and "malformed" in res["other_inner"][1], res["other_inner"]
        assert res["other_kept"] and res["counts_kept"]
        assert res["counts"][0] == "ValueError" and "rank 1: a malformed DiLoCo state dict" in res["counts"][1]
    assert len({res["stale"][1] for res in results}) == 1
    assert len({res["partial"] for res in results}) == 1


def differing_settings(case: str):
    """DiLoCo built with a setting that differs on rank 3 (an invalid one, or a valid other one)."""
    rank = rank_of(WORLD)
    model = make_model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    sync_every = {"invalid": 0, "other": 5}[case] if rank == 3 else 4
    return caught(DiLoCo, model.parameters(), inner, sync_every=sync_every, backend=gloo())


@pytest.mark.parametrize("case, says", [("invalid", "rank 3: invalid sync_every"), ("other", "different sync_every")])
def test_settings_that_differ_across_ranks_raise_on_every_rank(pool, case, says):
    results = pool.run(differing_settings, case)
    assert all(r is not None and r[0] == "ValueError" and says in r[1] for r in results), results


def unknown_backend_on_one_rank():
    """Rank 3 names a backend that does not exist: it raised there alone, and the other ranks
    waited in the settings' agreement."""
    model = make_model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    return caught(DiLoCo, model.parameters(), inner, sync_every=4, backend="nope" if rank_of(WORLD) == 3 else gloo())


def test_unknown_backend_on_one_rank_raises_on_every_rank(pool):
    results = pool.run(unknown_backend_on_one_rank)
    assert all(r is not None and r[0] == "ValueError" and "rank 3: unknown backend 'nope'" in r[1] for r in results)


def no_parameters_on_one_rank():
    """Rank 3 passes no parameters: torch's Optimizer raised there before DiLoCo's agreement,
    and the other ranks waited in it until the group's timeout."""
    model = make_model()
    params = [] if rank_of(WORLD) == 3 else list(model.parameters())
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    return caught(DiLoCo, params, inner, sync_every=4, backend=gloo())


def test_no_parameters_on_one_rank_raises_on_every_rank(pool):
    results = pool.run(no_parameters_on_one_rank)
    assert all(r is not None and r[0] == "ValueError" and "rank 3: " in r[1] for r in results), results
    assert "empty parameter list" in results[0][1], results


def save_on_four() -> bytes:
    _, opt = trained(3)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    return buf.getvalue()


def damage(saved: dict, case: str, rank: int) -> None:
    """`case`: "what, where", where a part of the per-rank file `saved` is made unusable on every
    rank ("all") or on rank 1 alone ("rank 1"). Saved after step 7: fragment 0 is in flight."""
    what, where = case.split(", ")
    if where == "rank 1" and rank != 1:
        return
    local, outer = saved["compcomm"]["rank_local"], saved["outer"]
    flight = local["in_flight"][0]
    if what == "outer lr < 0":
        outer["param_groups"][0]["lr"] = -0.7
    elif what == "outer lr nan":
        outer["param_groups"][0]["lr"] = math.nan
    elif what == "outer maximize":
        outer["param_groups"][0]["maximize"] = True
    elif what == "outer momentum":
        outer["param_groups"][0]["momentum"] = 0.901
    elif what == "momentum buffer nan":
        outer["state"][0]["momentum_buffer"][0] = math.nan
    elif what == "momentum buffer shape":
        outer["state"][0]["momentum_buffer"] = outer["state"][0]["momentum_buffer"][1:]
    elif what == "mean nan":
        flight["mean"][0][0] = math.nan
    elif what == "mean":
        flight["mean"][0][0] += 1e-3
    elif what == "landing":
        flight["apply_at"] = 100
    elif what == "fragment":
        flight["fragment"] = 7
    elif what == "first backward":
        local["backward_agreement"]["first_done"] = False
    elif what == "step":
        saved["compcomm"]["step"] = -3
    elif what == "theta nan":
        saved["synced"][0][0] = math.nan
    elif what == "theta shape":
        saved["synced"][0] = saved["synced"][0].reshape(2, -1)
    elif what == "sent at":
        saved["compcomm"]["scalars"]["sent_at"] = ["x", 4]
    else:
        assert what == "inner lr", what
        local["inner"]["param_groups"][0]["lr"] = -1.0


def load_damaged(case: str) -> tuple[tuple[str, str] | None, bool]:
    """What loading a damaged file raised, and whether the optimizer kept everything it held."""
    rank = rank_of(WORLD)
    model, opt = trained(7)
    saved = copy.deepcopy(opt.state_dict())
    damage(saved, case, rank)

    def held() -> tuple:
        return (
            state_bytes(model, opt),
            repr(opt.inner.state_dict()),
            repr(opt._sync.outer.state_dict()),
            opt.step_count,
        )

    before = held()
    return caught(opt.load_state_dict, saved), held() == before


@pytest.mark.parametrize(
    "case,says",
    [
        ("outer lr < 0, all", "rank 0: the checkpoint's outer optimizer: invalid outer_lr: -0.7"),
        ("outer lr nan, all", "invalid outer_lr: nan"),
        ("outer maximize, all", "the checkpoint's outer optimizer has {"),
        ("outer momentum, rank 1", "different saves"),
        ("momentum buffer nan, all", "the outer momentum of bucket 0 holds NaN or Inf"),
        ("momentum buffer shape, rank 1", "rank 1: the outer momentum of bucket 0 must be float32 of shape"),
        ("mean nan, all", "the landed mean of fragment 0 in flight holds NaN or Inf"),
        ("mean, rank 1", "different saves"),
        ("landing, all", "fragment 0 in flight lands at 100"),
        ("fragment, rank 1", "rank 1: the checkpoint's fragments in flight name 7"),
        ("first backward, rank 1", "different saves"),
        ("step, all", "step count must be an integer >= 0, got -3"),
        ("theta nan, all", "synced parameters of bucket 0 holds NaN or Inf"),
        ("theta shape, all", "synced parameters of bucket 0 must be float32 of shape"),
        ("sent at, all", "fragments' steps ['x', 4] are not local steps"),
        ("inner lr, all", "inner optimizer group 0 has the learning rate -1.0"),
    ],
)
def test_a_damaged_file_is_refused_on_every_rank_with_nothing_loaded(pool, case, says):
    """Each loaded before (an outer lr < 0 or NaN, a NaN in theta, a mean or momentum, a landing
    step that never comes: silently wrong numbers or syncs skipped for good), or crashed one rank
    alone mid-load or at a later step (a hang for the others), or let theta part across ranks (a
    fragment's mean or the outer momentum differing on one rank), or made one rank run a
    collective at its next backward that the others did not (the first-backward flag)."""
    for failure, kept in pool.run(load_damaged, case):
        assert failure is not None and failure[0] == "ValueError", failure
        assert says in failure[1], failure
        assert kept


def sound_but_unusual(case: str) -> tuple[bytes, bytes]:
    """A run whose files the load's checks first refused, resumed from a per-rank file after step
    `stop` and continued to step 10, against the run that never stopped: rank 1's parameters
    NaN from step 2 (the sync after step 4 fails on every rank and resets them; saved mid-way,
    and with the failed fragment in flight), its AdamW state overflowed to inf, an outer lr
    scheduled from 0 (with the scheduler's initial_lr in the outer group)."""
    rank = rank_of(WORLD)
    kw = dict(fragments=1, overlap_steps=2)
    stop = {"nan parameters": 3, "nan parameters in flight": 5, "inner inf": 4, "outer lr 0": 0}[case]

    def run(model: torch.nn.Module, opt: DiLoCo, steps: range) -> None:
        # (saved at step 0 alone, so that the resumed run's scheduler, made after the load, starts alike)
        warm = torch.optim.lr_scheduler.LambdaLR(opt.outer, lambda k: min(1.0, k / 4)) if case == "outer lr 0" else None
        for step in steps:
            backward(model, rank, step)
            first = next(model.parameters())
            if rank == 1 and step == 1 and case == "inner inf":
                first.grad.view(-1)[0] = 1e21  # AdamW's exp_avg_sq overflows; the parameter stays finite
            opt.step()
            if rank == 1 and step == 1 and case.startswith("nan"):
                with torch.no_grad():  # as an inner step that overflowed would leave it
                    first.view(-1)[0] = math.nan
            if warm is not None:
                warm.step()

    model = make_model()
    opt = make_diloco(model, **kw)
    run(model, opt, range(10))
    straight = state_bytes(model, opt)
    model = make_model()
    opt = make_diloco(model, **kw)
    run(model, opt, range(stop))
    saved = copy.deepcopy(opt.state_dict())
    model = make_model()
    opt = make_diloco(model, **kw)
    opt.load_state_dict(saved)
    run(model, opt, range(stop, 10))
    return straight, state_bytes(model, opt)


@pytest.mark.parametrize("case", ["nan parameters", "nan parameters in flight", "inner inf", "outer lr 0"])
def test_files_of_sound_runs_in_unusual_states_resume_bit_for_bit(pool, case):
    for straight, resumed in pool.run(sound_but_unusual, case):
        assert straight == resumed


def load_on_two(blob: bytes):
    opt = make_diloco(make_model(), world=2)
    return caught(opt.load_state_dict, torch.load(io.BytesIO(blob), weights_only=False))


def test_other_world_size_is_refused_on_every_rank(pool):
    blob = pool.run(save_on_four)[0]
    for failure in pool.run(load_on_two, blob, ranks=[0, 1]):
        assert failure is not None and failure[0] == "ValueError" and "saved on 4 ranks" in failure[1]


def frozen_bias(differ: bool = False) -> tuple[bytes, bytes, bool]:
    """Six compressed steps with the first layer's bias frozen at construction (with `differ`,
    on rank 1 only). Returns the frozen bias's bytes before and after, and whether the weights
    moved."""
    rank = rank_of(WORLD)
    model = make_model()
    bias = model[0].bias
    bias.requires_grad_(not (differ and rank == 1) if differ else False)
    before, weights = raw_tensor(bias), raw_tensor(model[0].weight)
    opt = make_diloco(model, sync_every=2, fragments=1, overlap_steps=0, bucket_bytes=4096)  # one bucket
    for step in range(6):
        backward(model, rank, step)
        opt.step()
    return before, raw_tensor(bias), raw_tensor(model[0].weight) != weights


def test_a_parameter_frozen_at_construction_is_left_as_it_is(pool):
    """requires_grad=False keeps a weight fixed, as with torch optimizers and DDP: the 1-bit mean
    of its zero pseudo-gradient is not zero, so it must not take part in the syncs."""
    for before, after, moved in pool.run(frozen_bias):
        assert after == before
        assert moved


def test_parameters_frozen_on_some_ranks_only_are_refused_on_every_rank(pool):
    errors = pool.run(caught, frozen_bias, True)
    assert all(e is not None and e[0] == "ValueError" and "requires_grad" in e[1] for e in errors), errors


def resume_before_a_non_finite_backward(resume: bool) -> tuple[list[bool], bytes]:
    """No GradScaler; rank 1's loss is inf at step 5, the first step after a checkpoint taken
    after 5 steps (with `resume`, loaded into a new model and optimizer). Returns which steps
    were skipped after it and the parameters at the end."""
    rank = rank_of(WORLD)
    model = make_model()
    opt = make_diloco(model, sync_every=4, fragments=1, overlap_steps=0)
    for step in range(5):
        backward(model, rank, step)
        opt.step()
    if resume:
        saved = copy.deepcopy(opt.state_dict())
        model = make_model()
        opt = make_diloco(model, sync_every=4, fragments=1, overlap_steps=0)
        opt.load_state_dict(saved)
    skipped = []
    for step in range(5, 9):
        loss_at(model, rank, step, overflow=step == 5 and rank == 1).backward()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt.step()
        skipped.append(opt.last_step_skipped)
    return skipped, raw(model)


def test_resumed_run_treats_its_first_backward_as_the_straight_run_does(pool):
    """The first backward of a run is agreed (a GradScaler is not known yet); the first after a
    resume is not the run's first, so only the rank with non-finite gradients skips."""
    straight = pool.run(resume_before_a_non_finite_backward, False)
    resumed = pool.run(resume_before_a_non_finite_backward, True)
    assert [s for s, _ in straight] == [[r == 1, False, False, False] for r in range(WORLD)]
    assert resumed == straight


# ------------------------------------------------------------------ GradScaler, non-finite values


def loss_at(model: torch.nn.Module, rank: int, step: int, overflow: bool = False) -> torch.Tensor:
    """The loss of rank `rank`'s batch at `step` (inf with `overflow`), gradients zeroed."""
    model.zero_grad(set_to_none=True)
    x, y = batch(rank, step)
    loss = torch.nn.functional.mse_loss(model(x), y)
    return loss * math.inf if overflow else loss


def scaled_run(
    bad_step: int, bad_rank: int, use_scaler: bool = True, start_iter: int = 0
) -> tuple[list[float], list[bool], bool, bytes]:
    """Train with torch.amp.GradScaler (or without, `use_scaler` False); at `bad_step` one rank's
    scaled loss is inf. Returns the scales, which steps were skipped, whether the skipped steps
    left the parameters as they were, and the parameters at the end."""
    rank = rank_of(WORLD)
    model = make_model()
    opt = make_diloco(model, sync_every=3, fragments=1, overlap_steps=0, start_iter=start_iter)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)  # powers of two: exact
    scales, skipped, unchanged = [], [], True
    for step in range(8):
        loss = loss_at(model, rank, step, overflow=step == bad_step and rank == bad_rank)
        before = raw(model)
        if use_scaler:
            scaler.scale(loss).backward()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        if opt.last_step_skipped and (step + 1) % 3:
            unchanged = unchanged and raw(model) == before
        scales.append(scaler.get_scale())
        skipped.append(opt.last_step_skipped)
    return scales, skipped, unchanged, raw(model)


@pytest.mark.parametrize("bad_step,start_iter", [(0, 0), (4, 0), (1, 3)])  # first backward, later, warm-up
def test_grad_scaler_skips_everywhere_and_scales_stay_equal(pool, bad_step, start_iter):
    results = pool.run(scaled_run, bad_step, 1, True, start_iter)
    for scales, skipped, unchanged, _ in results:
        assert scales == results[0][0]
        assert skipped == [s == bad_step for s in range(8)]
        assert unchanged
    before = results[0][0][bad_step - 1] if bad_step else 2.0**10
    assert results[0][0][bad_step] < before


@pytest.mark.parametrize("start_iter", [0, 3])
def test_grad_scaler_unscales_exactly(pool, start_iter):
    scaled, plain = pool.run(scaled_run, -1, 0, True, start_iter), pool.run(scaled_run, -1, 0, False, start_iter)
    assert [r[3] for r in scaled] == [r[3] for r in plain]
    assert len({r[3] for r in scaled}) == 4, "between syncs the ranks differ"


def late_scaler(case: str, given: bool) -> dict:
    """A GradScaler that DiLoCo would learn of only at the first `scaler.step` (unless `given`
    as grad_scaler). "accumulated": two backward passes per step from the first step on, rank
    1's second one of step 0 inf. "later": three steps without a scaler, then with one, rank 1's
    loss inf at step 3, the first scaled one. "resumed": the same, the scaled steps after a
    resume from a state saved without a scaler."""
    rank = rank_of(WORLD)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)  # powers of two: exact
    schedule: dict = dict(sync_every=3, fragments=1, overlap_steps=0)
    settings = dict(schedule, **({"grad_scaler": scaler} if given else {}))
    model = make_model()
    opt = make_diloco(model, **(schedule if case == "resumed" else settings))
    first_scaled = 0 if case == "accumulated" else 3
    micro_batches = 2 if case == "accumulated" else 1
    out: dict = {"scales": [], "skipped": [], "failure": None}
    for step in range(6):
        if step < first_scaled:
            backward(model, rank, step)
            opt.step()
            continue
        if step == first_scaled and case == "resumed":
            saved = copy.deepcopy(opt.state_dict())
            model = make_model()
            opt = make_diloco(model, **settings)
            opt.load_state_dict(saved)
        model.zero_grad(set_to_none=True)
        for m in range(micro_batches):
            x, y = batch(rank, 10 * step + m)
            loss = torch.nn.functional.mse_loss(model(x), y)
            overflow = step == first_scaled and rank == 1 and m == micro_batches - 1
            scaler.scale(loss * math.inf if overflow else loss).backward()
        before = raw(model)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out["failure"] = caught(scaler.step, opt)
        if out["failure"] is not None:
            out["unchanged"] = raw(model) == before and opt.step_count == step
            out["left_on_the_optimizer"] = [a for a in ("grad_scale", "found_inf") if hasattr(opt, a)]
            return out
        scaler.update()
        out["scales"].append(scaler.get_scale())
        out["skipped"].append(opt.last_step_skipped)
    return out


@pytest.mark.parametrize("case", ["accumulated", "later", "resumed"])
def test_a_scaler_given_to_diloco_skips_everywhere_with_equal_scales(pool, case):
    results = pool.run(late_scaler, case, True)
    steps = 6 if case == "accumulated" else 3
    for r in results:
        assert r["failure"] is None, r
        assert r["scales"] == results[0]["scales"]
        assert r["skipped"] == [s == 0 for s in range(steps)]
    assert results[0]["scales"][0] == 2.0**9


@pytest.mark.parametrize("case", ["accumulated", "later"])
def test_a_scaler_not_given_whose_unagreed_verdicts_differ_is_refused_on_every_rank(pool, case):
    """The scales used to part silently: now a ValueError on every rank at that step, nothing
    changed, and nothing of the scaler's left on the optimizer for the next step to read."""
    for r in pool.run(late_scaler, case, False):
        assert r["failure"] is not None and r["failure"][0] == "ValueError", r
        assert "found inf/NaN on 1 of 4 ranks" in r["failure"][1] and "grad_scaler=scaler" in r["failure"][1]
        assert r["unchanged"] and r["left_on_the_optimizer"] == []


def uneven_accumulation() -> list[int]:
    """No scaler: rank 0 accumulates two micro-batches before each step, the others one (the
    ranks are independent between syncs)."""
    rank = rank_of(WORLD)
    model = make_model()
    opt = make_diloco(model, sync_every=3, fragments=1, overlap_steps=0)
    for step in range(4):
        model.zero_grad(set_to_none=True)
        for m in range(2 if rank == 0 else 1):
            x, y = batch(rank, 10 * step + m)
            torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [opt.step_count]


def test_ranks_may_run_different_numbers_of_backward_passes_without_a_scaler(pool):
    assert pool.run(uneven_accumulation) == [[4]] * WORLD


def checkpointed_first_step() -> tuple[list[float], list[bool]]:
    """Every Linear under reentrant activation checkpointing, a GradScaler not given to DiLoCo;
    at step 0 (the run's first backward, agreed since the scaler is not known yet) rank 1's
    gradient of the first Linear's weight is inf: it comes in the last of the nested backward
    passes, after the first nested one ended. The scale after each step, and whether it was
    skipped."""
    from reentrant import scaled_step, through_reentrant_checkpoints

    rank = rank_of(WORLD)
    model = make_model()
    opt = make_diloco(model, sync_every=3, fragments=1, overlap_steps=0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=100)
    scales, skipped = [], []
    for step in range(3):
        model.zero_grad(set_to_none=True)
        x, y = batch(rank, step)
        h = through_reentrant_checkpoints(model, x.requires_grad_())
        poison = next(model.parameters()).register_hook(lambda g: g * math.inf) if rank == 1 and step == 0 else None
        scaler.scale(torch.nn.functional.mse_loss(h, y)).backward()
        if poison is not None:
            poison.remove()
        scaled_step(scaler, opt)
        scales.append(scaler.get_scale())
        skipped.append(opt.last_step_skipped)
    return scales, skipped


def test_the_first_backward_is_agreed_whole_under_reentrant_checkpointing(pool):
    """Its nested backward passes agree as they end without ending it: the inf of the last one
    is agreed too, so every rank skips and the scales stay equal (the first nested end used to
    count as the run's first backward, the rest went unagreed: a ValueError at the step)."""
    results = pool.run(checkpointed_first_step)
    for scales, skipped in results:
        assert scales == results[0][0]
        assert skipped == [True, False, False]


def nan_pseudo_gradient(passes: int) -> dict:
    """H = 3. Step 2: rank 1's gradient is NaN (it alone skips its inner step). Step 6 (a sync):
    rank 2's parameters are poisoned, so its pseudo-gradient is NaN."""
    rank = rank_of(WORLD)
    model = make_model()
    opt = make_diloco(model, sync_every=3, fragments=1, overlap_steps=0, passes=passes)
    out: dict = {}
    caught_warnings = []
    for step in range(1, 10):
        backward(model, rank, step)
        if step == 2 and rank == 1:
            next(model.parameters()).grad.view(-1)[0] = math.nan
        if step == 6:
            theta = b"".join(raw_tensor(g) for g in opt.global_parameters())
            momentum = b"".join(raw_tensor(s["momentum_buffer"]) for s in opt.outer.state.values())
            errors = state_bytes(model, opt)[2]
            if rank == 2:
                next(model.parameters()).data.view(-1)[0] = math.nan
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            opt.step()
        caught_warnings += [str(w.message) for w in seen]
        if step == 2:
            out["skipped_at_2"] = opt.last_step_skipped
        if step == 6:
            out["unchanged"] = (
                b"".join(raw_tensor(g) for g in opt.global_parameters()) == theta
                and b"".join(raw_tensor(s["momentum_buffer"]) for s in opt.outer.state.values()) == momentum
                and state_bytes(model, opt)[2] == errors
            )
            out["reset_to_theta"] = all(torch.equal(p, g) for p, g in zip(model.parameters(), opt.global_parameters()))
    out["skipped_syncs"] = opt.skipped_syncs
    out["finite"] = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    out["params"] = raw(model)
    out["warnings"] = caught_warnings
    return out


@pytest.mark.parametrize("passes", [1, 2])
def test_non_finite_pseudo_gradient_skips_the_sync_everywhere(pool, passes):
    """With passes=2 the refused first call makes no second one: the errors stay as they were."""
    results = pool.run(nan_pseudo_gradient, passes)
    for rank, res in enumerate(results):
        assert res["skipped_at_2"] == (rank == 1)
        assert res["unchanged"] and res["reset_to_theta"]
        assert res["skipped_syncs"] == 1 and res["finite"]
        assert any("sync of fragment 0 skipped on every rank" in w for w in res["warnings"])
    assert len({res["params"] for res in results}) == 1, "the sync at step 9 went ahead"


# ------------------------------------------------------------------ equal starts, refused parameters


def unequal_start() -> tuple[list[str], bytes, bool, tuple | None]:
    rank = rank_of(WORLD)
    torch.manual_seed(rank)
    model = torch.nn.Linear(5, 3)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        DiLoCo(model.parameters(), torch.optim.SGD(model.parameters(), lr=0.1), backend=gloo())
    again = equalize_from_rank0(list(model.parameters()), gloo())
    shapes = [torch.nn.Parameter(torch.zeros(3 if rank == 3 else 4))]
    failure = caught(equalize_from_rank0, shapes, gloo())
    return [str(w.message) for w in seen], raw(model), again, failure


def test_unequal_initial_parameters_are_equalized_from_rank0_with_a_warning(pool):
    results = pool.run(unequal_start)
    torch.manual_seed(0)
    expected = raw(torch.nn.Linear(5, 3))
    for messages, params, again, failure in results:
        assert any("differed across the 4 ranks" in m for m in messages)
        assert params == expected and again is False
        assert failure is not None and failure[0] == "ValueError" and "shape" in failure[1]


def refused_parameters() -> list:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor
    from torch.nn.parallel import DistributedDataParallel

    model = make_model()
    ddp = DistributedDataParallel(model, process_group=group(WORLD))
    wrapped = caught(DiLoCo, ddp.parameters(), torch.optim.AdamW(ddp.parameters()), backend=gloo())
    mesh = init_device_mesh("cpu", (WORLD,))
    sharded = torch.nn.Parameter(distribute_tensor(torch.zeros(8), mesh, [Replicate()]))
    dtensor = caught(DiLoCo, [sharded], torch.optim.SGD([sharded], lr=0.1), backend=gloo())
    return [wrapped, dtensor]


def test_ddp_and_dtensor_parameters_are_refused(pool):
    for wrapped, dtensor in pool.run(refused_parameters):
        assert wrapped is not None and wrapped[0] == "ValueError" and "DistributedDataParallel" in wrapped[1]
        assert dtensor is not None and dtensor[0] == "ValueError" and "DTensor" in dtensor[1]


# ------------------------------------------------------------------ one process


def local_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = make_model()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


@pytest.mark.parametrize(
    "kw,error",
    [
        (dict(sync_every=0), ValueError),
        (dict(sync_every=2.5), ValueError),
        (dict(fragments=0), ValueError),
        (dict(fragments=5, bucket_bytes=200), ValueError),  # 4 buckets
        (dict(fragments=5, sync_every=8), ValueError),  # 4 parameters: at most 4 buckets
        (dict(fragments=3, sync_every=2, bucket_bytes=200), ValueError),
        (dict(overlap_steps=4, sync_every=4), ValueError),
        (dict(outer_lr=0.0), ValueError),
        (dict(outer_momentum=1.0), ValueError),
        (dict(outer_momentum=0.0), ValueError),  # with nesterov=True
        (dict(start_iter=-1), ValueError),
        (dict(passes=0), ValueError),
        (dict(passes=2, compress=False), ValueError),
        (dict(passes_until=-1), ValueError),
        (dict(rotate=True, compress=False), ValueError),
        (dict(rotate=1), TypeError),
        (dict(compress=1), TypeError),
        (dict(backend=3), TypeError),
    ],
)
def test_invalid_arguments(kw, error):
    model, inner = local_model()
    with pytest.raises(error):
        DiLoCo(model.parameters(), inner, **dict(dict(backend="local"), **kw))


def test_a_parameter_unfrozen_after_construction_warns_that_it_is_not_synced():
    model, inner = local_model()
    model[0].bias.requires_grad_(False)
    opt = DiLoCo(model.parameters(), inner, backend="local")
    model[0].bias.requires_grad_(True)
    backward(model, 0, 0)
    with pytest.warns(RuntimeWarning, match="never synced"):
        opt.step()


def test_a_group_added_to_inner_after_construction_is_refused_before_any_step():
    """It would train on each rank alone and never be synced; it was accepted silently."""
    model, inner = local_model()
    opt = DiLoCo(model.parameters(), inner, backend="local")
    head = torch.nn.Parameter(torch.ones(3))
    inner.add_param_group({"params": [head]})
    backward(model, 0, 0)
    head.grad = torch.ones(3)
    before = [p.detach().clone() for p in [*model.parameters(), head]]
    with pytest.raises(ValueError, match="now holds 5 parameters where it held 4 when DiLoCo was built"):
        opt.step()
    assert all(torch.equal(a, p) for a, p in zip(before, [*model.parameters(), head]))
    assert opt.step_count == 0


def test_an_inner_optimizer_listing_a_parameter_twice_still_steps():
    """torch accepts a group that repeats a parameter (with a warning); the check against groups
    added later counted the repeat against DiLoCo's own parameters and refused the first step."""
    model = make_model()
    params = list(model.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        inner = torch.optim.SGD([{"params": [*params, params[0]]}], lr=0.1)
    opt = DiLoCo(model.parameters(), inner, backend="local", sync_every=2)
    for t in range(3):
        backward(model, 0, t)
        opt.step()
    assert opt.step_count == 3


def test_reading_the_error_feedback_waits_for_the_fragments_in_flight():
    """A fragment's collective writes its buckets' errors in the background: the property handed
    them out while it might still be writing."""
    model, inner = local_model()
    opt = DiLoCo(model.parameters(), inner, backend="local", sync_every=4, fragments=2, bucket_bytes=200)
    for t in range(2):
        backward(model, 0, t)
        opt.step()
    assert opt._sync.in_flight, "a fragment was sent at step 2 and lands at step 3"
    assert len(opt.error_feedback) == 4  # a bucket per parameter
    assert all(entry.handle is None for entry in opt._sync.in_flight.values())
    assert opt._sync.in_flight, "waited for, not landed: it still lands at its own step"


def test_a_state_saved_with_other_parameters_frozen_is_refused_naming_them():
    """Parameters frozen at construction are left out of the synced buckets, so a state saved
    with another choice of them does not fit; the refusal named parameters and bucket_bytes only."""
    model, inner = local_model()
    model[0].bias.requires_grad_(False)
    saved = DiLoCo(model.parameters(), inner, backend="local").state_dict()
    model[0].bias.requires_grad_(True)
    opt = DiLoCo(model.parameters(), torch.optim.AdamW(model.parameters(), lr=1e-2), backend="local")
    with pytest.raises(ValueError, match="requires_grad=False at construction"):
        opt.load_state_dict(saved)


def test_inner_must_be_a_local_optimizer_over_the_same_parameters():
    model, inner = local_model()
    with pytest.raises(TypeError):
        DiLoCo(model.parameters(), "adamw", backend="local")
    with pytest.raises(ValueError, match="exactly the parameters"):
        DiLoCo(list(model.parameters())[:2], inner, backend="local")
    with pytest.raises(ValueError, match="communicates"):
        DiLoCo(model.parameters(), OnebitAdam(model.parameters(), backend="local"), backend="local")
    with pytest.raises(ValueError, match="float32"):
        double = torch.nn.Linear(2, 2).double()
        DiLoCo(double.parameters(), torch.optim.SGD(double.parameters(), lr=0.1), backend="local")
    with pytest.raises(TypeError, match="closure"):
        DiLoCo(model.parameters(), torch.optim.LBFGS(model.parameters()), backend="local")
    frozen = make_model().requires_grad_(False)
    with pytest.raises(ValueError, match="requires_grad"):
        DiLoCo(frozen.parameters(), torch.optim.SGD(frozen.parameters(), lr=0.1), backend="local")


def scheduled(target: str, resume_at: int | None = None) -> tuple[list[float], bytes]:
    """Six steps with a LambdaLR on `target`; with `resume_at`, the optimizer and the scheduler
    are saved after that many steps and loaded into new ones, which take the rest."""

    def build(model: torch.nn.Module, inner: torch.optim.Optimizer) -> tuple[DiLoCo, Any]:
        opt = DiLoCo(model.parameters(), inner, sync_every=2, backend="local")
        return opt, torch.optim.lr_scheduler.LambdaLR(inner if target == "inner" else opt, lambda s: 0.5**s)

    model, inner = local_model()
    opt, sched = build(model, inner)
    lrs = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. "lr_scheduler.step() before optimizer.step()"
        for step in range(6):
            if step == resume_at:
                saved = copy.deepcopy((opt.state_dict(), sched.state_dict()))
                inner = type(inner)(model.parameters(), lr=1e-2)
                opt, sched = build(model, inner)
                opt.load_state_dict(saved[0])
                sched.load_state_dict(saved[1])
            backward(model, 0, step)
            opt.step()
            sched.step()
            lrs.append(inner.param_groups[0]["lr"])
    return lrs, raw(model)


def test_lr_scheduler_on_the_inner_optimizer_or_on_diloco():
    on_inner, on_diloco = scheduled("inner"), scheduled("diloco")
    assert on_inner == on_diloco
    assert on_inner[0] == pytest.approx([1e-2 * 0.5**k for k in range(1, 7)])


@pytest.mark.parametrize("target", ["inner", "diloco"])
def test_lr_scheduler_resumes_after_load_state_dict(target):
    """The inner optimizer's load_state_dict gives it new group dicts; a scheduler on the DiLoCo
    object kept scheduling the old ones (fails before: the learning rate stayed at 1.25e-3)."""
    assert scheduled(target, resume_at=3) == scheduled(target)


def warmup_against_adamw() -> tuple[list[bytes], float]:
    """start_iter = 3, H = 2: three data-parallel steps (AdamW on the exact mean gradient), then a
    local step and a sync."""
    rank = rank_of(WORLD)
    model, ref = make_model(), make_model()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt = DiLoCo(model.parameters(), inner, sync_every=2, start_iter=3, backend=gloo())
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    per_step, worst = [], 0.0
    for step in range(5):
        backward(model, rank, step)
        opt.step()
        per_step.append(raw(model))
        if step < 3:
            grads = [torch.zeros_like(p) for p in ref.parameters()]
            for r in range(WORLD):
                backward(ref, r, step)
                for acc, p in zip(grads, ref.parameters()):
                    acc += p.grad / WORLD
            for p, g in zip(ref.parameters(), grads):
                p.grad = g
            ref_opt.step()
            worst = max(worst, max(float((a - b).abs().max()) for a, b in zip(model.parameters(), ref.parameters())))
    return per_step, worst


def test_warm_up_steps_are_data_parallel_then_local(pool):
    results = pool.run(warmup_against_adamw)
    for step in range(5):
        assert (len({r[0][step] for r in results}) == 1) == (step != 3), f"step {step + 1}"
    assert max(r[1] for r in results) < 1e-6


def test_warm_up_then_local_steps_on_one_process():
    model, inner = local_model()
    opt = DiLoCo(model.parameters(), inner, sync_every=2, start_iter=3, backend="local")
    for step in range(7):
        backward(model, 0, step)
        opt.step()
        if step == 2:  # the end of the warm-up: theta taken from the parameters
            assert all(torch.equal(p, g) for p, g in zip(model.parameters(), opt.global_parameters()))
    assert opt.step_count == 7 and opt.skipped_steps == 0


@pytest.mark.parametrize("fragments", [1, 2, 4])
def test_fragments_on_a_small_model_need_no_bucket_bytes(fragments):
    """A model under `fragments` x 25 MiB (every test-sized one) made one bucket, and any
    fragments > 1 was a ValueError unless bucket_bytes was passed too: now the buckets shrink
    until there are enough, their sizes as even as whole parameters allow."""
    model, inner = local_model()
    opt = DiLoCo(model.parameters(), inner, sync_every=4, fragments=fragments, backend="local")
    schedule = opt._sync.schedule
    sizes = [sum(opt._sync.layout.sizes()[b] for b in buckets) for buckets in schedule.buckets]
    assert len(schedule) == fragments and sum(sizes) == sum(p.numel() for p in model.parameters())
    assert len(opt._sync.layout) == (1 if fragments == 1 else fragments)
    for step in range(6):
        backward(model, 0, step)
        opt.step()
    assert opt.step_count == 6 and opt.skipped_steps == 0
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


def test_sync_now_sends_only_fragments_that_moved():
    model, inner = local_model()
    opt = DiLoCo(model.parameters(), inner, sync_every=2, fragments=2, overlap_steps=1, bucket_bytes=200)
    for step in range(4):  # fragment 1 sent at step 4, in flight
        backward(model, 0, step)
        opt.step()
    theta = [g.clone() for g in opt.global_parameters()]
    opt.sync()  # lands fragment 1 (sent at this step: not sent again), sends fragment 0
    assert opt._sync.sent_at == [4, 4] and not opt._sync.in_flight
    assert all(torch.equal(p, g) for p, g in zip(model.parameters(), opt.global_parameters()))
    moved = [not torch.equal(a, b) for a, b in zip(theta, opt.global_parameters())]
    assert all(moved)
    theta = [g.clone() for g in opt.global_parameters()]
    opt.sync()  # nothing moved since
    assert all(torch.equal(a, b) for a, b in zip(theta, opt.global_parameters()))


def test_a_checkpoint_saved_before_passes_and_rotate_existed_loads_as_one_plain_pass():
    model, inner = local_model()
    opt = DiLoCo(model.parameters(), inner, sync_every=2, backend="local")
    for step in range(3):
        backward(model, 0, step)
        opt.step()
    state = opt.state_dict()
    for key in ("passes", "passes_until", "rotate"):
        del state["schedule"][key]
    model, inner = local_model()
    DiLoCo(model.parameters(), inner, sync_every=2, backend="local").load_state_dict(state)
    for other in (dict(passes=2), dict(rotate=True)):  # errors kept unrotated would be misread
        model, inner = local_model()
        with pytest.raises(ValueError, match="schedule"):
            DiLoCo(model.parameters(), inner, sync_every=2, backend="local", **other).load_state_dict(state)

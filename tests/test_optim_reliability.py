"""compcomm.optim under misuse and mixed precision, on real gloo ranks: GradScaler, checkpoints
across ranks, all-or-nothing steps over several buckets, overflow, frozen parameters, warnings."""

from __future__ import annotations

import gc
import io
import math
import warnings
import weakref
from typing import Any

import pytest
import torch
from test_optim import OPTIMIZERS, backward, batch, make_model, make_optimizer, rank_of, raw, snapshot

import compcomm
from compcomm.optim import DiLoCo, OnebitAdam, OnebitOptimizer, ZeroOneAdam

from rankpool import caught, group


def error_bytes(opt: OnebitOptimizer) -> bytes:
    return b"".join(
        ef.worker_error.numpy().tobytes() + ef.server_error.numpy().tobytes()
        for ef in opt.error_feedback
        if ef.initialized
    )


# ------------------------------------------------------------------ GradScaler


def scaled_run(
    name: str, bad_step: int, bad_rank: int, clipped: bool = False
) -> tuple[list[float], list[bool], bool, bytes]:
    """Train with torch.amp.GradScaler; at `bad_step` one rank's scaled gradient overflows;
    `clipped`: the gradients unscaled (`scaler.unscale_`) and clipped before each step.
    Returns the scale after every step, which steps were skipped, whether the skipped step
    changed anything, and the final parameters."""
    rank = rank_of(4)
    model = make_model()
    opt = make_optimizer(name, model, 4, 3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    scales, skipped, unchanged = [], [], True
    for step in range(8):
        model.zero_grad(set_to_none=True)
        x, y = batch(rank, step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        if step == bad_step and rank == bad_rank:
            loss = loss * math.inf
        scaler.scale(loss).backward()
        if clipped:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        before = snapshot(model, opt)
        scaler.step(opt)
        scaler.update()
        if opt.last_step_skipped:
            unchanged = unchanged and snapshot(model, opt) == before
        scales.append(scaler.get_scale())
        skipped.append(opt.last_step_skipped)
    return scales, skipped, unchanged, raw(model)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("bad_step", [0, 2, 5])  # the first step, warm-up, compression stage
@pytest.mark.parametrize("clipped", [False, True])
def test_grad_scaler_skips_everywhere_and_scales_stay_equal(pool, name, bad_step, clipped):
    results = pool.run(scaled_run, name, bad_step, 1, clipped)
    for scales, skipped, unchanged, final in results:
        assert scales == results[0][0]
        assert skipped == [s == bad_step for s in range(8)]
        assert unchanged
        assert final == results[0][3]
    before = results[0][0][bad_step - 1] if bad_step else 2.0**10
    assert results[0][0][bad_step] < before  # the scaler backed off on every rank


def scaled_resumed(name: str) -> tuple[list[float], list[bool]]:
    """GradScaler training saved after 4 steps and resumed (model, optimizer and scaler) in
    fresh objects, where rank 1's loss overflows at the first step after the resume."""
    rank = rank_of(4)

    def step(model: torch.nn.Module, opt: Any, scaler: torch.amp.GradScaler, t: int) -> None:
        x, y = batch(rank, t)
        loss = torch.nn.functional.mse_loss(model(x), y) * (math.inf if t == 4 and rank == 1 else 1.0)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()

    model = make_model()
    opt = make_optimizer(name, model, 4, 2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    for t in range(4):
        step(model, opt, scaler, t)
    saved = {"model": model.state_dict(), "opt": opt.state_dict(), "scaler": scaler.state_dict()}
    model = make_model()
    model.load_state_dict(saved["model"])
    opt = make_optimizer(name, model, 4, 2)
    opt.load_state_dict(saved["opt"])
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    scaler.load_state_dict(saved["scaler"])
    scales, skipped = [], []
    for t in range(4, 7):
        step(model, opt, scaler, t)
        scales.append(scaler.get_scale())
        skipped.append(opt.last_step_skipped)
    return scales, skipped


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_grad_scaler_after_a_resume_backs_off_alike(pool, name):
    """The first backward after a resume agrees on non-finite gradients, as a run's first does:
    the scales stayed 2x apart for good."""
    results = pool.run(scaled_resumed, name)
    for scales, skipped in results:
        assert scales == results[0][0]
        assert skipped == [True, False, False]


def scaled_matches_unscaled(name: str) -> tuple[bytes, bytes]:
    """A GradScaler with a power-of-two scale changes nothing in the result."""
    rank = rank_of(4)
    out = []
    for use_scaler in (False, True):
        model = make_model()
        opt = make_optimizer(name, model, 4, 3)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1000)
        for step in range(6):
            model.zero_grad(set_to_none=True)
            x, y = batch(rank, step)
            loss = torch.nn.functional.mse_loss(model(x), y)
            if use_scaler:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            else:
                loss.backward()
                opt.step()
        out.append(raw(model))
    return out[0], out[1]


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_grad_scaler_unscales_exactly(pool, name):
    for plain, scaled in pool.run(scaled_matches_unscaled, name):
        assert plain == scaled


# ------------------------------------------------------------------ checkpoints across ranks


def trained(name: str, steps: int) -> tuple[torch.nn.Module, OnebitOptimizer]:
    rank = rank_of(4)
    model = make_model()
    opt = make_optimizer(name, model, 4, 2, weight_decay=0.01)
    for step in range(steps):
        backward(model, rank, step)
        opt.step()
    return model, opt


def lr_changed_on_one_rank(name: str, what: str = "lr") -> tuple[list[tuple[str, str] | None], bytes]:
    """Rank 1's learning rate set apart after the first steps (a scheduler or a hand-set lr
    gone wrong on one rank): only the first step compared the settings, and the parameters
    drifted apart silently. Refused at every step until it agrees again, nothing changed.
    `what="frozen"`: rank 1 freezes the first layer's weight instead (requires_grad=False, a
    freeze that depends on the rank), which was not compared at all (from a probe)."""
    rank = rank_of(4)
    model = make_model()
    if name == "zeroone":
        be = compcomm.backends.get("gloo", group=group(4))
        opt: OnebitOptimizer = ZeroOneAdam(model.parameters(), lr=1e-2, var_freeze_step=2, backend=be)
    else:
        opt = make_optimizer(name, model, 4, 2)
    failures = []
    for step in range(5):
        if rank == 1 and step in (2, 4):  # set apart, then agreeing again
            if what == "lr":
                opt.param_groups[0]["lr"] = 0.05 if step == 2 else 1e-2
            else:
                model[0].weight.requires_grad_(step == 4)
        backward(model, rank, step)
        failures.append(caught(opt.step))
    return failures, raw(model)


@pytest.mark.parametrize(
    ("what", "says"), [("lr", "param_groups[0].lr"), ("frozen", "param_groups[0] parameters frozen")]
)
@pytest.mark.parametrize("name", [*OPTIMIZERS, "zeroone"])
def test_a_setting_changed_on_one_rank_after_the_first_step_is_refused_at_every_step(pool, name, what, says):
    results = pool.run(lr_changed_on_one_rank, name, what)
    for failures, _ in results:
        assert failures[:2] == [None, None] and failures[4] is None, failures
        assert all(f is not None and f[0] == "ValueError" and says in f[1] for f in failures[2:4]), failures
    assert len({params for _, params in results}) == 1


def from_rank0(obj):
    """Rank 0's `obj` on every rank, through a file's bytes (what a shared checkpoint file gives)."""
    import torch.distributed as dist

    buf = io.BytesIO()
    torch.save(obj, buf)
    blob = [buf.getvalue()]
    dist.broadcast_object_list(blob, src=0, group=group(4))
    return torch.load(io.BytesIO(blob[0]), weights_only=False)


def rank0_file_everywhere(name: str) -> tuple | None:
    _, opt = trained(name, 4)
    saved = from_rank0(opt.state_dict())
    fresh = make_optimizer(name, make_model(), 4, 2)
    return caught(fresh.load_state_dict, saved)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_rank0_state_loaded_everywhere_raises_on_every_rank(pool, name):
    failures = pool.run(rank0_file_everywhere, name)
    assert all(f is not None and f[0] == "ValueError" for f in failures)
    assert "rank 0" in failures[1][1] and "gathered_state_dict" in failures[1][1]
    assert "rank(s) [1, 2, 3]" in failures[0][1]


def refused_loads(name: str) -> dict:
    """Per-rank files refused on every rank with nothing loaded: rank 1's error feedback holds a
    NaN; rank 2's file is of an earlier step than the others'."""
    import copy

    rank = rank_of(4)
    _, opt = trained(name, 4)
    earlier = copy.deepcopy(opt.state_dict())
    model, opt = trained(name, 5)
    mine = copy.deepcopy(opt.state_dict())
    before = (raw(model), error_bytes(opt), opt.step_count)
    corrupt = copy.deepcopy(mine)
    if rank == 1:
        corrupt["compcomm"]["error_feedback"][0]["worker_error"][0] = float("nan")
    out = {"corrupt": caught(opt.load_state_dict, corrupt)}
    out["stale"] = caught(opt.load_state_dict, earlier if rank == 2 else mine)
    out["kept"] = (raw(model), error_bytes(opt), opt.step_count) == before
    return out


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_refused_loads_raise_on_every_rank_with_nothing_loaded(pool, name):
    for res in pool.run(refused_loads, name):
        assert res["corrupt"][0] == "ValueError" and "rank 1: bucket 0's error feedback" in res["corrupt"][1]
        assert res["stale"][0] == "ValueError" and "different saves" in res["stale"][1]
        assert res["kept"]


MALFORMED = {  # case: (what rank 1's file, or every rank's, lacks or holds; what every rank is told)
    "no_error_feedback": (True, lambda sd: sd["compcomm"].pop("error_feedback"), "KeyError: 'error_feedback'"),
    "no_step": (True, lambda sd: sd["compcomm"].pop("step"), "step count must be an integer"),
    "a_parameter_without_state": (True, lambda sd: sd["state"].pop(0), "different saves"),
    "nan_moment": (False, lambda sd: sd["state"][0]["exp_avg"].view(-1)[0].fill_(float("nan")), "holds NaN or Inf"),
    "float64_moment": (False, lambda sd: sd["state"][0].update(exp_avg=sd["state"][0]["exp_avg"].double()), "float32"),
    "reshaped_moment": (
        False,
        lambda sd: sd["state"][0].update(exp_avg=sd["state"][0]["exp_avg"].reshape(-1)),
        "of shape",
    ),
    "negative_step": (False, lambda sd: sd["compcomm"].update(step=-5), "step count must be an integer >= 0"),
    "no_buckets": (False, lambda sd: sd["compcomm"].update(error_feedback=[]), "error feedback for 0 buckets"),
    "another_class": (False, lambda sd: sd["compcomm"].update(optimizer="Adam"), "saved by Adam, not"),
}


def malformed_loads(name: str) -> dict:
    """States that torch's load took, per rank, and failed on (KeyError, a math domain error) or
    trained on wrongly later (a moment restarted from zero on one rank, NaN moments skipping
    every step): each is now refused on every rank alike, with nothing loaded."""
    import copy

    rank = rank_of(4)
    model, opt = trained(name, 5)
    saved = opt.state_dict()
    before = snapshot(model, opt)
    out = {}
    for case, (one_rank, corrupt, _) in MALFORMED.items():
        state = copy.deepcopy(saved)
        if rank == 1 or not one_rank:
            corrupt(state)
        out[case] = caught(opt.load_state_dict, state)
    out["kept"] = snapshot(model, opt) == before
    return out


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_malformed_states_are_refused_on_every_rank_with_nothing_loaded(pool, name):
    results = pool.run(malformed_loads, name)
    for case, (_, _, says) in MALFORMED.items():
        found = [res[case] for res in results]
        assert len(set(found)) == 1 and found[0] is not None and found[0][0] == "ValueError", (case, found)
        assert says in found[0][1], (case, found[0])
    assert all(res["kept"] for res in results)


def test_an_empty_state_entry_is_no_difference_between_ranks():
    """Reading opt.state[p] (a defaultdict) saves an empty entry: per-rank files of one save that
    differed only by it, one rank having logged a moment, were refused as different saves."""
    from compcomm.optim import checkpoints

    moments = {0: {"exp_avg": torch.ones(3), "exp_avg_sq": torch.ones(3)}}
    for values in (False, True):
        assert checkpoints.state_digest({**moments, 1: {}}, {}, values) == checkpoints.state_digest(moments, {}, values)


def test_a_subclass_and_a_state_saved_before_the_held_buffers_load():
    """A subclass that only logs was refused a state saved by its base class (the class was
    compared by name), and a OnebitLamb state saved before exp_avg_sq_fresh was kept from the
    start was refused as partial; both hold what the optimizer needs."""
    from compcomm.optim import OnebitLamb

    class Logged(OnebitAdam):
        pass

    model = make_model()
    opt = OnebitAdam(model.parameters(), freeze_step=2, backend="local")
    backward(model, 0, 0)
    opt.step()
    Logged(model.parameters(), freeze_step=2, backend="local").load_state_dict(opt.state_dict())
    opt.load_state_dict(Logged(model.parameters(), freeze_step=2, backend="local").state_dict())
    lamb = OnebitLamb(model.parameters(), freeze_step=2, backend="local")
    backward(model, 0, 1)
    lamb.step()
    older = lamb.state_dict()
    for entry in older["state"].values():
        entry.pop("exp_avg_sq_fresh")
    OnebitLamb(model.parameters(), freeze_step=2, backend="local").load_state_dict(older)


CHOICES = "local, gloo, nccl, mpi, shm, hierarchical or pass a Backend"


def unknown_backend(name: str, everywhere: bool) -> dict:
    """Rank 1 (or every rank) names a backend that does not exist: every rank's first step
    raises, and again on the next try, nothing changed, and so does gathered_state_dict. On rank
    1 alone it raised there and the others waited at step 1; on every rank, a first version of
    the fix trained on the default transport. `opt.backend` raises the name's own error on the
    ranks given it (it returned the default transport)."""
    import compcomm

    rank = rank_of(4)
    model = make_model()
    refused = rank == 1 or everywhere
    backend = "nope" if refused else compcomm.backends.get("gloo", group=group(4))
    opt = OPTIMIZERS[name](model.parameters(), freeze_step=2, lr=1e-2, backend=backend)
    before = raw(model)
    backward(model, rank, 0)
    tries = [caught(opt.step), caught(opt.step), caught(opt.gathered_state_dict)]
    own = caught(lambda: opt.backend)
    kept = raw(model) == before and opt.step_count == 0
    return {"tries": tries, "kept": kept, "own": own, "refused": refused}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("everywhere", [False, True])
def test_unknown_backend_raises_on_every_rank(pool, name, everywhere):
    says = "rank(s) [0, 1, 2, 3] failed; rank 0: unknown backend" if everywhere else "rank 1: unknown backend"
    for res in pool.run(unknown_backend, name, everywhere):
        assert all(t is not None and t[0] == "ValueError" and says in t[1] for t in res["tries"]), res
        assert res["kept"], res
        if res["refused"]:
            assert res["own"] == ("ValueError", "unknown backend 'nope'; choose one of " + CHOICES), res
        else:
            assert res["own"] is None, res


def one_file_resume(name: str) -> tuple[bytes, bytes, bytes, bytes]:
    rank = rank_of(4)
    model, opt = trained(name, 8)
    straight, straight_ef = raw(model), error_bytes(opt)

    model, opt = trained(name, 4)
    saved = from_rank0({"model": model.state_dict(), "opt": opt.gathered_state_dict()})
    model = make_model()
    model.load_state_dict(saved["model"])
    opt = make_optimizer(name, model, 4, 2, weight_decay=0.01)
    opt.load_state_dict(saved["opt"])
    for step in range(4, 8):
        backward(model, rank, step)
        opt.step()
    return straight, raw(model), straight_ef, error_bytes(opt)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_gathered_state_dict_resumes_every_rank_exactly(pool, name):
    for straight, resumed, ef_a, ef_b in pool.run(one_file_resume, name):
        assert straight == resumed
        assert ef_a == ef_b and ef_a


# ------------------------------------------------------------------ all-or-nothing steps


def bad_second_bucket(name: str, how: str) -> tuple[bool, bool, list[bool], bool]:
    """Compression stage, several buckets; in the second bucket rank 2's gradient is NaN
    ("nan"), or every rank's momentum is 3e38, so that the average overflows fp32 ("overflow").
    Returns (skipped, nothing changed, per bucket: error state unchanged, parameters finite)."""
    rank = rank_of(4)
    model = make_model()
    opt = make_optimizer(name, model, 4, 2)
    opt.bucket_bytes = 200
    for step in range(4):
        backward(model, rank, step)
        opt.step()
    second = [list(model.parameters())[i] for i in opt._rounds.lay_out().parameters_of(1)]
    if how == "overflow":
        for p in second:
            opt.state[p]["exp_avg"].fill_(3e38)
    backward(model, rank, 4)
    if how == "nan" and rank == 2:
        second[0].grad.view(-1)[0] = math.nan
    before, errors = snapshot(model, opt), [ef.worker_error.clone() for ef in opt.error_feedback]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt.step()
    same = [bool(torch.equal(a, ef.worker_error)) for a, ef in zip(errors, opt.error_feedback)]
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    return opt.last_step_skipped, snapshot(model, opt) == before, same, finite


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("how", ["nan", "overflow"])
def test_bad_second_bucket_leaves_every_bucket_unchanged(pool, name, how):
    for skipped, unchanged, same, finite in pool.run(bad_second_bucket, name, how):
        assert skipped and unchanged and all(same) and finite
        assert len(same) >= 3


def warmup_overflow_unchanged(name: str) -> tuple[bool, bool]:
    rank = rank_of(4)
    model = make_model()
    opt = make_optimizer(name, model, 4, 100)
    backward(model, rank, 0)
    if rank < 2:
        with torch.no_grad():
            next(model.parameters()).grad.view(-1)[0] = 3e38
    before = snapshot(model, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt.step()
    skipped, unchanged = opt.last_step_skipped, snapshot(model, opt) == before
    backward(model, rank, 1)
    opt.step()
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    return skipped and unchanged, finite and opt.step_count == 1


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_warmup_sum_overflow_skips_with_nothing_changed(pool, name):
    """Finite gradients of 3e38 on two ranks overflow fp32 when summed: skipped everywhere."""
    assert all(a and b for a, b in pool.run(warmup_overflow_unchanged, name))


# ------------------------------------------------------------------ frozen parameters, warnings


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_frozen_parameter_gets_no_weight_decay(name):
    model = make_model()
    model[0].bias.requires_grad_(False)
    frozen = model[0].bias.detach().clone()
    opt = OPTIMIZERS[name](model.parameters(), lr=1e-2, weight_decay=0.5, freeze_step=2, backend="local")
    ref_model = make_model()
    ref_model[0].bias.requires_grad_(False)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.5)
    for step in range(5):
        for m, o in ((model, opt), (ref_model, ref)):
            backward(m, 0, step)
            o.step()
    assert torch.equal(model[0].bias.detach(), frozen)
    assert torch.equal(ref_model[0].bias.detach(), frozen)


def skipped_twice(name: str) -> tuple[int, int, list[str]]:
    rank = rank_of(4)
    model = make_model()
    opt = make_optimizer(name, model, 4, 2)
    with warnings.catch_warnings(record=True) as caught_warnings:
        warnings.simplefilter("always")
        for step in range(4):
            backward(model, rank, step)
            if step in (1, 3) and rank == 3:
                next(model.parameters()).grad.view(-1)[0] = math.inf
            opt.step()
    messages = [str(w.message) for w in caught_warnings if issubclass(w.category, RuntimeWarning)]
    return opt.skipped_steps, opt.step_count, messages


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_skipped_step_warns_once_and_counts(pool, name):
    for skipped, steps, messages in pool.run(skipped_twice, name):
        assert (skipped, steps) == (2, 2)
        assert len(messages) == 1 and "skipped" in messages[0] and "skipped_steps" in messages[0]


# ------------------------------------------------------------------ the collectives of a step pair up


def two_parameters(name: str, overlap: bool, case: str) -> bytes:
    """Two 16-element parameters in buckets of their own, 3 steps (warm-up, then 1 bit): on odd
    ranks their gradients become ready in the other order ("order"), or one of them gets none
    ("unused"), or there is no backward at step 2 ("no_backward")."""
    rank = rank_of(4)
    torch.manual_seed(0)
    a, b = torch.nn.Parameter(torch.randn(16)), torch.nn.Parameter(torch.randn(16))
    backend = compcomm.backends.get("gloo", group=group(4))
    opt = OPTIMIZERS[name]([a, b], lr=1e-2, freeze_step=2, backend=backend)
    opt.bucket_bytes, opt.overlap = 64, overlap
    for step in range(4):
        g = torch.Generator().manual_seed(10 * step + rank)
        x, y = torch.randn(16, generator=g), torch.randn(16, generator=g)
        opt.zero_grad()
        odd = rank % 2 == 1
        if case == "no_backward" and odd and step == 2:
            pass
        elif case == "unused" and odd:
            (b * y).sum().backward()
        elif case == "order" and odd:
            (b * (a * x).sum() * y).sum().backward()  # b's gradient is ready first
        else:
            (a * (b * y).sum() * x).sum().backward()  # a's gradient is ready first
        opt.step()
    return torch.cat([a.detach(), b.detach()]).numpy().tobytes()


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("case", ["order", "unused", "no_backward"])
def test_overlapped_buckets_pair_up_whatever_the_ranks_backward(pool, name, case):
    """Buckets start in their agreed order on every rank, so a rank whose gradients become
    ready in another order, or never, or that has no backward at all, sends bucket b with
    bucket b: before, such ranks' parameters drifted apart (max difference 4e-2), or the
    collectives paired a bucket with the step's verdict (gloo aborted, or every rank waited)."""
    overlapped = pool.run(two_parameters, name, True, case)
    plain = pool.run(two_parameters, name, False, case)
    assert len(set(overlapped)) == 1 and overlapped == plain


def differing_setting(name: str, setting: str) -> tuple[str, str] | None:
    rank = rank_of(4)
    model = make_model()
    opt = make_optimizer(name, model, 4, 2)
    if setting == "bucket_bytes":
        opt.bucket_bytes = 64 if rank == 1 else 1 << 20
    elif setting == "overlap":
        opt.overlap = rank != 1
    else:
        opt.param_groups[0]["exp_avg_mask"] = torch.full((1,), 0.0 if rank == 1 else 1.0)
    backward(model, rank, 0)
    return caught(opt.step)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("setting", ["bucket_bytes", "overlap", "exp_avg_mask"])
def test_settings_that_differ_across_ranks_raise_on_every_rank(pool, name, setting):
    """bucket_bytes and overlap decide a backward's collectives (differing, gloo aborted or the
    ranks waited); an exp_avg_mask that differs let the parameters drift apart silently."""
    for result in pool.run(differing_setting, name, setting):
        assert result is not None and result[0] == "ValueError"
        assert f"ranks passed different {setting}" in result[1] or f"].{setting}" in result[1]


def sparse_on_one_rank(name: str) -> list[tuple[str, str] | None]:
    """An embedding whose gradient turns sparse on rank 1 only: at the first backward (before
    the buckets are laid out), then after two dense steps (its bucket is sent during backward)."""
    rank = rank_of(4)
    outcomes = []
    for sparse_from in (0, 2):
        torch.manual_seed(0)
        emb, head = torch.nn.Embedding(10, 4), torch.nn.Linear(4, 1)
        backend = compcomm.backends.get("gloo", group=group(4))
        opt = OPTIMIZERS[name]([*emb.parameters(), *head.parameters()], lr=1e-2, freeze_step=2, backend=backend)
        for step in range(3):
            emb.sparse = rank == 1 and step >= sparse_from
            opt.zero_grad()

            def step_once() -> None:
                head(emb(torch.tensor([1, 2, 3 + rank]))).sum().backward()
                opt.step()

            outcome = caught(step_once)
            if outcome is not None:
                outcomes.append((step, *outcome))
                break
        outcomes.append(opt.step_count)
    return outcomes


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_sparse_gradients_on_one_rank_raise_on_every_rank(pool, name):
    """Rank 1 alone raised (its check ran before the agreement) and the others waited for it."""
    for outcomes in pool.run(sparse_on_one_rank, name):
        (step_a, kind_a, says_a), steps_a, (step_b, kind_b, says_b), steps_b = outcomes
        assert (step_a, steps_a, step_b, steps_b) == (0, 0, 2, 2)
        assert kind_a == kind_b == "RuntimeError" and "1 rank(s)" in says_a and "sparse gradients" in says_b


def batchless_rank_under_scaler(
    name: str, zero_loss: bool, clipped: bool = False
) -> tuple[tuple[str, str] | None, list[float], int]:
    """GradScaler training where rank 1 has no batch at step 2 and rank 0's loss overflows
    there: rank 1 calls step() without a backward, or (`zero_loss`) runs a backward of a zero
    loss as the refusal asks; `clipped`: the gradients unscaled and clipped before each step."""
    rank = rank_of(4)
    model = make_model()
    opt = make_optimizer(name, model, 4, 2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)
    scales, failure = [], None
    for step in range(4):
        opt.zero_grad(set_to_none=False)
        if rank == 1 and step == 2:
            if zero_loss:
                scaler.scale(0 * sum(p.sum() for p in model.parameters())).backward()
        else:
            x, y = batch(rank, step)
            loss = torch.nn.functional.mse_loss(model(x), y) * (math.inf if rank == 0 and step == 2 else 1.0)
            failure = failure or caught(scaler.scale(loss).backward)
        if clipped and failure is None:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        failure = failure or caught(scaler.step, opt)
        if failure is not None:
            break
        scaler.update()
        scales.append(scaler.get_scale())
    return failure, scales, opt.step_count


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("clipped", [False, True])
def test_a_step_without_backward_under_a_grad_scaler_is_refused_on_every_rank(pool, name, clipped):
    """The scaler checks for inf before step(), where a batchless rank's agreement came too late
    to mark its gradients: rank 0 backed off while rank 1 grew, for good (scales 4x apart)."""
    for failure, scales, steps in pool.run(batchless_rank_under_scaler, name, False, clipped):
        assert failure is not None and failure[0] == "ValueError" and "without a backward" in failure[1]
        assert scales == [2.0**11, 2.0**12] and steps == 2
    results = pool.run(batchless_rank_under_scaler, name, True, clipped)
    assert all(failure is None for failure, _, _ in results)
    assert len({tuple(scales) for _, scales, _ in results}) == 1 and results[0][1][2] == 2.0**11


# ------------------------------------------------------------------ lifetime


def dropped_optimizer(kind: str) -> tuple[bool, int, bool]:
    """An optimizer of `kind` built on a model and stepped past its freeze (a sync for DiLoCo),
    then dropped while the model is kept (as a run that builds a new optimizer does): whether it
    was collected and how many of its hooks the parameters still hold; then, after another
    backward, whether the parameters are collected once the model is dropped too."""
    rank = rank_of(4)
    model = make_model()
    backend = compcomm.backends.get("gloo", group=group(4))
    if kind == "diloco":
        opt: torch.optim.Optimizer = DiLoCo(
            list(model.parameters()), torch.optim.SGD(model.parameters(), lr=1e-2), 2, backend=backend
        )
    elif kind == "zeroone":
        opt = ZeroOneAdam(model.parameters(), lr=1e-2, backend=backend)
    else:
        opt = make_optimizer(kind, model, 4, 2)
    for step in range(4):
        backward(model, rank, step)
        opt.step()
    collected = weakref.ref(opt)
    del opt
    gc.collect()
    hooks = sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())
    backward(model, rank, 4)
    param = weakref.ref(next(model.parameters()))
    del model
    gc.collect()
    return collected() is None, hooks, param() is None


@pytest.mark.parametrize("kind", [*OPTIMIZERS, "zeroone", "diloco"])
def test_a_dropped_optimizer_is_collected_with_its_state(pool, kind):
    """Each parameter's post-accumulate-grad hook held the optimizer, and torch keeps those hooks
    where the garbage collector does not look: a dropped optimizer, its state and error buffers,
    and the model's parameters stayed alive for the life of the process."""
    assert pool.run(dropped_optimizer, kind) == [(True, 0, True)] * 4


def replaced_optimizer(name: str, collected_on: tuple[int, ...]) -> tuple[tuple[str, str] | None, bytes]:
    """Train, then build a new optimizer of `name` on the same parameters in place of the first
    (`opt = OnebitAdam(...)` again); the first, now garbage, is collected on the ranks
    `collected_on` only (a collector runs when each rank's allocations say so), then training
    goes on: the error if any, and the parameters."""
    rank = rank_of(4)
    model = make_model()
    gc.disable()
    try:
        opt = make_optimizer(name, model, 4, 2)
        for step in range(3):
            backward(model, rank, step)
            opt.step()
        opt = make_optimizer(name, model, 4, 2)
        if rank in collected_on:
            gc.collect()
        failure = None
        for step in range(3, 6):
            backward(model, rank, step)
            failure = failure or caught(opt.step)
    finally:
        gc.enable()
    return failure, raw(model)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_replaced_optimizer_stops_hearing_from_the_parameters_on_every_rank_alike(pool, name):
    """A new optimizer on the parameters takes their hooks over when it is built: the old one,
    until each rank's collector freed it, started its own bucket collectives on some ranks only,
    and the ranks' collectives stopped pairing."""
    skewed = pool.run(replaced_optimizer, name, (0,))
    assert all(failure is None for failure, _ in skewed)
    assert skewed == pool.run(replaced_optimizer, name, (0, 1, 2, 3))

"""ZeroOneAdam (0/1 Adam) on real gloo ranks, and the masking / fp32-master rules shared by the
compressed optimizers: a model with a parameter that gets (almost) no gradient stays close to
AdamW; bf16 parameters keep updates below bf16's spacing."""

from __future__ import annotations

import io
import math
import re
import warnings

import pytest
import torch
from test_optim import DTYPES, backward, make_model, rank_of, raw, scheduler_for, snapshot
from test_optim_reliability import error_bytes, from_rank0

import compcomm
from compcomm.optim import OnebitAdam, OnebitLamb, ZeroOneAdam

from rankpool import caught, group

SCHEDULE = dict(var_freeze_step=12, var_update_scaler=2, local_step_scaler=3, local_step_clipper=4)
STEPS = 30  # phase 1: refreshes at 1, 2, 4, 6, 10, 12 (1-bit gradients between); phase 2 to 30


def make_zeroone(model: torch.nn.Module, **kw) -> ZeroOneAdam:
    kw = {**SCHEDULE, "lr": 1e-2, "weight_decay": 0.01, **kw}
    return ZeroOneAdam(model.parameters(), backend=compcomm.backends.get("gloo", group=group(4)), **kw)


def train(dtype: str, steps: int = STEPS) -> tuple[list[bytes], list[str]]:
    rank = rank_of(4)
    model = make_model(dtype)
    opt = make_zeroone(model)
    params, kinds = [], []
    for step in range(steps):
        kinds.append(opt._kind(step + 1))
        backward(model, rank, step, dtype)
        opt.step()
        params.append(raw(model))
    return params, kinds


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_identical_after_every_synchronized_step_and_local_between(pool, dtype):
    results = pool.run(train, dtype)
    kinds = results[0][1]
    assert {"exact", "compressed", "local"} <= set(kinds)
    for step, kind in enumerate(kinds):
        distinct = len({r[0][step] for r in results})
        if kind == "local":
            assert distinct == 4, f"step {step + 1}: local steps follow each rank's own gradient"
        else:
            assert distinct == 1, f"ranks differ after the {kind} step {step + 1}"
    assert len({results[0][0][s] for s in range(STEPS)}) == STEPS


FROZEN = {  # when the first layer's weight has requires_grad=False, by step t
    "at the freeze step": lambda t: t == SCHEDULE["var_freeze_step"],
    "from the start to past it": lambda t: t <= SCHEDULE["var_freeze_step"] + 2,
    "between syncs": lambda t: 22 <= t <= 25,  # a local step at 21 moved it, a sync at 24
}


def trained_with_a_layer_frozen(when: str) -> tuple[list[bytes], list[str], list[float], list[bool]]:
    rank = rank_of(4)
    model = make_model()
    opt = make_zeroone(model)
    weight, frozen = model[0].weight, FROZEN[when]
    params, kinds, norms, kept = [], [], [], []
    for step in range(STEPS):
        t = step + 1
        weight.requires_grad_(not frozen(t))
        before = weight.detach().clone()
        backward(model, rank, step)
        opt.step()
        params.append(raw(model))
        kinds.append(opt._kind(t))
        norms.append(float(weight.norm()))
        kept.append(torch.equal(before, weight) or not frozen(t))
    return params, kinds, norms, kept


@pytest.mark.parametrize("when", list(FROZEN))
def test_a_layer_frozen_for_some_steps_trains_on_and_syncs(pool, when):
    """A weight frozen at the freeze step, or from the start until after it, then trained: its
    first local step raised KeyError: 'lr_sum' (and its weights at the last sync were zeros, so
    a sync would have wiped it). A weight frozen after local steps had moved it was left out of
    the next sync, so the ranks' weights differed after it (from a probe). Now every sync leaves
    every rank bitwise equal, a frozen weight moves only where a sync averages its local steps,
    and none is wiped."""
    results = pool.run(trained_with_a_layer_frozen, when)
    kinds = results[0][1]
    for step, kind in enumerate(kinds):
        if kind != "local":
            assert len({r[0][step] for r in results}) == 1, f"ranks differ after the {kind} step {step + 1}"
    for _, _, norms, kept in results:
        assert min(norms) > 0.5 * norms[0], norms
        moved = [t for t, ok in enumerate(kept, 1) if not ok]
        assert moved == ([24] if when == "between syncs" else []), moved


def intervals() -> tuple[list[str], int, int]:
    model = make_model()
    opt = ZeroOneAdam(model.parameters(), backend="local", **SCHEDULE)
    kinds = []
    for step in range(STEPS):
        kinds.append(opt._kind(step + 1))
        backward(model, 0, step)
        opt.step()
    return kinds, opt.var_updates, opt.local_interval


@pytest.mark.parametrize(
    "scalar, value, says",
    [("local_interval", 0, "local_interval must be an integer >= 1, got 0"), ("var_counter", 1.5, ">= 0, got 1.5")],
)
def test_a_state_with_an_impossible_schedule_is_refused(scalar, value, says):
    """local_interval = 0 loaded, then divided by zero at the next step (on the rank whose file
    held it, while the others waited)."""
    model = make_model()
    opt = ZeroOneAdam(model.parameters(), backend="local", **SCHEDULE)
    for step in range(3):
        backward(model, 0, step)
        opt.step()
    state = opt.state_dict()
    state["compcomm"]["scalars"][scalar] = value
    with pytest.raises(ValueError, match=re.escape(says)):
        opt.load_state_dict(state)


def local_scaler_differs() -> tuple:
    """Rank 3 passes another local_step_scaler: step 1 compares the schedule's settings."""
    rank = rank_of(4)
    model = make_model()
    opt = make_zeroone(model, local_step_scaler=8 if rank == 3 else 4)
    backward(model, rank, 0)
    return caught(opt.step), opt.step_count


def test_a_schedule_that_differs_across_ranks_raises_on_every_rank(pool):
    """It paired a local step on one rank with a compressed one on another (every rank waited)."""
    for failure, steps in pool.run(local_scaler_differs):
        assert failure is not None and failure[0] == "ValueError" and "local_step_scaler" in failure[1], failure
        assert steps == 0


def learning_rate_decayed_to_zero() -> tuple[list[str], list[bool], bytes]:
    """Phase 2 with a sync every step; the learning rate is 0 from step 6 on (a schedule that
    decays to 0), so that a sync's summed learning rates L are 0."""
    rank = rank_of(4)
    model = make_model()
    opt = make_zeroone(model, var_freeze_step=3, var_update_scaler=1, local_step_scaler=100, local_step_clipper=1)
    kinds, zero_momenta = [], []
    for step in range(8):
        if step == 5:
            for group in opt.param_groups:
                group["lr"] = 0.0
        kinds.append(opt._kind(step + 1))
        backward(model, rank, step)
        opt.step()
        zero_momenta.append(all(not opt.state[p]["exp_avg"].any() for p in model.parameters()))
    return kinds, zero_momenta, raw(model)


def test_a_sync_after_steps_at_learning_rate_zero_steps(pool):
    """m <- -b1(t) u d / L is undefined at L = 0: such a sync sets m to 0 alike on every rank
    (before, every rank raised ZeroDivisionError after w had already changed)."""
    results = pool.run(learning_rate_decayed_to_zero)
    kinds, zero_momenta, _ = results[0]
    assert kinds[3:] == ["compressed"] * 5
    assert zero_momenta[:5] == [False] * 5 and zero_momenta[5:] == [True] * 3
    assert len({final for _, _, final in results}) == 1


def test_schedule_follows_deepspeeds_parameters():
    kinds, refreshes, interval = intervals()
    exact = [t + 1 for t, k in enumerate(kinds) if k == "exact"]
    assert exact == [1, 2, 4, 6, 8, 12]  # 2 refreshes per spacing, spacing doubling
    assert refreshes == 6
    synced = [t + 1 for t, k in enumerate(kinds) if t + 1 > 12 and k == "compressed"]
    assert synced == [13, 14, 15, 16, 18, 20, 24, 28]  # H = 1, 1, 1, 2, 2, 2, then 4 (clipped)
    assert interval == 4


# ------------------------------------------------------------------ checkpoints in every stage


def straight_vs_resumed(stop: int, gathered: bool, scheduled: bool = False) -> tuple[bytes, bytes, bytes, bytes]:
    rank = rank_of(4)
    model = make_model()
    opt = make_zeroone(model)
    scheduler = scheduler_for(opt, STEPS, scheduled)
    for step in range(STEPS):
        backward(model, rank, step)
        opt.step()
        if scheduler is not None:
            scheduler.step()
    straight, straight_ef = raw(model), error_bytes(opt)

    model = make_model()
    opt = make_zeroone(model)
    scheduler = scheduler_for(opt, STEPS, scheduled)
    for step in range(stop):
        backward(model, rank, step)
        opt.step()
        if scheduler is not None:
            scheduler.step()
    schedule = None if scheduler is None else scheduler.state_dict()
    if gathered:  # one file from rank 0, loaded everywhere
        saved = from_rank0({"model": model.state_dict(), "opt": opt.gathered_state_dict(), "scheduler": schedule})
    else:
        saved = through_a_file({"model": model.state_dict(), "opt": opt.state_dict(), "scheduler": schedule})
    model = make_model()
    model.load_state_dict(saved["model"])
    opt = make_zeroone(model)
    scheduler = scheduler_for(opt, STEPS, scheduled)
    opt.load_state_dict(saved["opt"])
    if scheduler is not None:
        scheduler.load_state_dict(saved["scheduler"])
    for step in range(stop, STEPS):
        backward(model, rank, step)
        opt.step()
        if scheduler is not None:
            scheduler.step()
    return straight, raw(model), straight_ef, error_bytes(opt)


def through_a_file(obj: dict) -> dict:
    """`obj` as torch.load reads it back from a file torch.save wrote."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return torch.load(io.BytesIO(buf.getvalue()), weights_only=False)


def saved_after(steps: int) -> tuple[int, dict]:
    """This rank, and the state dict of its ZeroOneAdam after `steps` steps."""
    rank = rank_of(4)
    model = make_model()
    opt = make_zeroone(model)
    for step in range(steps):
        backward(model, rank, step)
        opt.step()
    return rank, opt.state_dict()


def a_bad_local_part_on_one_rank(kind: str) -> tuple[tuple[str, str] | None, int, bytes, bytes]:
    """Saved mid local-step interval (step 21: the weights and momenta differ across ranks and
    travel as each rank's local part); rank 1's part is made unusable before the load."""
    rank, saved = saved_after(21)
    local = saved["compcomm"]["rank_local"]
    assert local, "step 21 is mid-interval: the local part is not empty"
    if rank == 1:
        if kind == "shape":
            local["weights"][0] = local["weights"][0].reshape(-1)[:-1].clone()
        elif kind == "count":
            local["exp_avg"] = local["exp_avg"][:-1]
        elif kind == "dtype":  # it was stored as it came: rank 1 alone then failed at its next step
            local["exp_avg"][0] = local["exp_avg"][0].double()
        elif kind == "nan":  # it was loaded: every rank then skipped step after step
            local["weights"][0][0] = float("nan")
        else:
            local["weights"][-1] = "not a tensor"
    fresh_model = make_model()
    fresh = make_zeroone(fresh_model)
    before = raw(fresh_model)
    failure = caught(fresh.load_state_dict, saved)
    return failure, fresh.step_count, before, raw(fresh_model)


@pytest.mark.parametrize("kind", ["shape", "count", "type", "dtype", "nan"])
def test_one_ranks_unusable_local_part_is_refused_on_every_rank_before_loading(pool, kind):
    """It was restored after the load's agreement: rank 1 raised (a shape mismatch in a copy)
    with the rest of its state loaded, while the other ranks resumed."""
    for failure, steps, before, after in pool.run(a_bad_local_part_on_one_rank, kind):
        assert failure is not None and failure[0] == "ValueError" and "local-step" in failure[1], failure
        assert steps == 0 and before == after


def a_malformed_file_on_one_rank(kind: str) -> tuple[tuple[str, str] | None, int, bytes, bytes]:
    """Rank 1's file is damaged where only the load's agreements (or torch's load after them) read
    it: it raised there alone, and the others hung in the agreement or resumed."""
    rank = rank_of(4)

    def build() -> tuple[torch.nn.Module, ZeroOneAdam]:
        model = make_model()
        params = list(model.parameters())
        groups = [{"params": params[:1]}, {"params": params[1:]}]
        backend = compcomm.backends.get("gloo", group=group(4))
        return model, ZeroOneAdam(groups, backend=backend, **{**SCHEDULE, "lr": 1e-2, "weight_decay": 0.01})

    model, opt = build()
    for step in range(5):
        backward(model, rank, step)
        opt.step()
    saved = opt.state_dict()
    if kind == "scalar":  # on every rank (so the ranks' digests agree): none of the optimizer's counters
        saved["compcomm"]["scalars"]["var_freeze_step"] = 3
    elif rank == 1:
        first, second = saved["param_groups"]
        if kind == "groups none":
            saved["param_groups"] = None
        elif kind == "group not a dict":
            saved["param_groups"] = ["oops", second]
        elif kind == "schedule":
            saved["compcomm"]["schedule"] = {"var_freeze_step": "12"}
        elif kind == "between syncs":
            saved["compcomm"]["between_syncs"] = "yes"
        elif kind == "regrouped":  # as many groups, the same settings: torch's load raised on rank 1 alone
            both = first["params"] + second["params"]
            saved["param_groups"] = [{**first, "params": both[:2]}, {**second, "params": both[2:]}]
        else:
            saved["state"][0] = {**saved["state"][0], 5: torch.zeros(1)}
    fresh_model, fresh = build()
    before = raw(fresh_model)
    failure = caught(fresh.load_state_dict, saved)
    return failure, fresh.step_count, before, raw(fresh_model)


@pytest.mark.parametrize(
    "kind", ["groups none", "group not a dict", "schedule", "between syncs", "regrouped", "state key", "scalar"]
)
def test_a_file_malformed_on_one_rank_is_refused_on_every_rank(pool, kind):
    for failure, steps, before, after in pool.run(a_malformed_file_on_one_rank, kind):
        assert failure is not None and failure[0] == "ValueError", failure
        assert steps == 0 and before == after


def refused_load_then_training_from_scratch() -> tuple[tuple[str, str] | None, bytes, bytes]:
    """Rank 1's file is no compcomm state (a plain torch optimizer's, say), the others' are: the
    load is refused everywhere, and training starts from scratch. The refused load had laid the
    buckets out on the other ranks only, so their first backward skipped the agreement on the
    order that rank 1's ran: gloo aborted on mismatched sizes."""
    rank, saved = saved_after(5)
    if rank == 1:
        del saved["compcomm"]
    fresh_model = make_model()
    fresh = make_zeroone(fresh_model)
    failure = caught(fresh.load_state_dict, saved)
    reference_model = make_model()
    reference = make_zeroone(reference_model)
    for m, o in ((fresh_model, fresh), (reference_model, reference)):
        for step in range(4):
            backward(m, rank, step)
            o.step()
    return failure, raw(fresh_model), raw(reference_model)


def test_a_refused_load_leaves_the_buckets_as_they_were(pool):
    for failure, trained, reference in pool.run(refused_load_then_training_from_scratch):
        assert failure is not None and failure[0] == "ValueError", failure
        assert trained == reference


@pytest.mark.parametrize(
    "stop,gathered", [(3, False), (12, True), (13, False), (19, True), (21, False), (21, True)]
)  # phase 1, freeze, first sync, mid-interval
def test_resumes_bit_for_bit_in_any_stage(pool, stop, gathered):
    for straight, resumed, ef_a, ef_b in pool.run(straight_vs_resumed, stop, gathered):
        assert straight == resumed
        assert ef_a == ef_b


def test_resumes_bit_for_bit_under_a_scheduler(pool):
    """The synchronization's payload scales by the learning rate the scheduler set after the
    load, not by the one of the groups the optimizer was built with."""
    for straight, resumed, ef_a, ef_b in pool.run(straight_vs_resumed, 13, False, True):
        assert straight == resumed
        assert ef_a == ef_b


# ------------------------------------------------------------------ NaN agreement and GradScaler


def nan_in_local_step(bad_step: int) -> tuple[bool, bool, bytes, bytes]:
    rank = rank_of(4)
    model = make_model()
    opt = make_zeroone(model)
    skipped = unchanged = False
    for step in range(STEPS):
        if step == bad_step:
            backward(model, rank, step)
            if rank == 1:
                next(model.parameters()).grad.view(-1)[0] = math.nan
            before = snapshot(model, opt)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                opt.step()
            skipped, unchanged = opt.last_step_skipped, snapshot(model, opt) == before
        backward(model, rank, step)
        opt.step()
    clean = make_model()
    clean_opt = make_zeroone(clean)
    for step in range(STEPS):
        backward(clean, rank, step)
        clean_opt.step()
    return skipped, unchanged, raw(model), raw(clean)


@pytest.mark.parametrize("bad_step", [2, 8, 16, 21])  # a 1-bit gradient, a refresh, a local step, a sync
def test_non_finite_gradient_skips_everywhere(pool, bad_step):
    for skipped, unchanged, final, clean in pool.run(nan_in_local_step, bad_step):
        assert skipped and unchanged and final == clean


def scaled(bad_step: int, clipped: bool = False) -> tuple[list[float], list[bool]]:
    rank = rank_of(4)
    model = make_model()
    opt = make_zeroone(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    scales, skipped = [], []
    from test_optim import batch

    for step in range(STEPS):
        model.zero_grad(set_to_none=True)
        x, y = batch(rank, step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        if step == bad_step and rank == 3:
            loss = loss * math.inf
        scaler.scale(loss).backward()
        if clipped:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        skipped.append(opt.last_step_skipped)
    return scales, skipped


@pytest.mark.parametrize("clipped", [False, True])
def test_grad_scaler_in_local_steps(pool, clipped):
    results = pool.run(scaled, 17, clipped)
    for scales, skipped in results:
        assert scales == results[0][0]
        assert skipped == [s == 17 for s in range(STEPS)]


# ------------------------------------------------------------------ parameters without gradient


class Attention(torch.nn.Module):
    """One self-attention block: the key bias gets ~no gradient (softmax ignores it)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(8, 16)
        self.attn = torch.nn.MultiheadAttention(16, 2, batch_first=True)
        self.out = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        return self.out(self.attn(h, h, h, need_weights=False)[0]).mean(1)


def magnitudes(kind: str, steps: int) -> dict[str, float]:
    rank = rank_of(4)
    model = Attention()
    be = compcomm.backends.get("gloo", group=group(4))
    if kind == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    elif kind == "onebit_adam":
        opt = OnebitAdam(model.parameters(), lr=3e-3, weight_decay=0.01, freeze_step=20, backend=be)
    elif kind == "onebit_lamb":
        opt = OnebitLamb(model.parameters(), lr=3e-3, weight_decay=0.01, freeze_step=20, backend=be)
    else:
        opt = ZeroOneAdam(
            model.parameters(),
            lr=3e-3,
            weight_decay=0.01,
            var_freeze_step=20,
            var_update_scaler=4,
            local_step_scaler=20,
            local_step_clipper=4,
            backend=be,
        )
    import torch.distributed as dist

    for step in range(steps):
        g = torch.Generator().manual_seed(31 * step + rank)
        x = torch.randn(16, 6, 8, generator=g)
        model.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(model(x), x[:, 0, :4].sin()).backward()
        if kind == "adamw":  # the exact data-parallel mean for the reference, in one collective
            grads = [p.grad for p in model.parameters()]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=group(4))
            for g, mean in zip(grads, torch.split(flat / 4, [g.numel() for g in grads])):
                g.copy_(mean.view_as(g))
        opt.step()
    return {name: float(p.detach().abs().max()) for name, p in model.named_parameters()}


_ADAMW: dict[str, float] = {}


@pytest.mark.parametrize("kind", ["onebit_adam", "onebit_lamb", "zeroone"])
def test_parameter_without_gradient_stays_near_adamw(pool, kind):
    """Without the automatic mask, the key bias reaches |w| > 1000 (AdamW: < 0.1)."""
    reference = _ADAMW or _ADAMW.update(pool.run(magnitudes, "adamw", 150)[0]) or _ADAMW
    ours = pool.run(magnitudes, kind, 150)[0]
    for name, ref in reference.items():
        assert ours[name] <= 3 * ref + 1e-3, (name, ours[name], ref)


def test_negligible_second_moment_is_masked():
    """The rule: sqrt(v_hat) <= eps masks; anything above does not."""
    from compcomm.optim.updates import adam_denominator, negligible

    v = torch.tensor([0.0, 1e-20, 0.99e-16, 1.1e-16, 1e-6])
    masked = negligible(adam_denominator(v, 0.0, 1, 1e-8), 1e-8)
    assert masked.tolist() == [True, True, True, False, False]


def masked_group(name: str) -> tuple[bool, bool]:
    """exp_avg_mask: a masked row moves only by weight decay in the compression stage."""
    rank = rank_of(4)
    model = make_model()
    mask = torch.ones(16, 8)
    mask[3] = 0.0
    first, rest = model[0].weight, [p for n, p in model.named_parameters() if n != "0.weight"]
    be = compcomm.backends.get("gloo", group=group(4))
    groups = [{"params": [first], "exp_avg_mask": mask}, {"params": rest}]
    if name == "zeroone":
        opt = ZeroOneAdam(groups, lr=1e-2, backend=be, **SCHEDULE)
        start = SCHEDULE["var_freeze_step"]
    else:
        opt = OnebitAdam(groups, lr=1e-2, freeze_step=3, backend=be)
        start = 3
    for step in range(start + 6):
        backward(model, rank, step)
        opt.step()
        if step + 1 == start:
            frozen_row = first[3].detach().clone()
            other_row = first[4].detach().clone()
    return bool(torch.equal(first[3].detach(), frozen_row)), not torch.equal(first[4].detach(), other_row)


@pytest.mark.parametrize("name", ["onebit_adam", "zeroone"])
def test_exp_avg_mask_per_group(pool, name):
    assert all(still and moved for still, moved in pool.run(masked_group, name))


# ------------------------------------------------------------------ fp32 master weights


@pytest.mark.parametrize("cls", [OnebitAdam, ZeroOneAdam])
def test_bf16_updates_below_bf16_spacing_accumulate(cls):
    p = torch.nn.Parameter(torch.ones(64, dtype=torch.bfloat16))
    kw = dict(freeze_step=5) if cls is OnebitAdam else dict(var_freeze_step=5)
    opt = cls([p], lr=1e-4, backend="local", **kw)
    for _ in range(60):  # each update ~1e-4, far below bf16's spacing at 1.0 (2^-7)
        p.grad = torch.ones_like(p)
        opt.step()
    master = opt.state[p]["master"]
    assert master.dtype == torch.float32
    assert float(master.max()) < 1.0 - 50e-4
    assert torch.equal(p.detach(), master.to(torch.bfloat16))
    assert float(p.detach().max()) < 1.0
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    assert "master" in torch.load(io.BytesIO(buf.getvalue()), weights_only=False)["state"][0]


@pytest.mark.parametrize("cls", [OnebitAdam, ZeroOneAdam])
def test_a_bf16_runs_master_does_not_outlive_a_resume_in_fp32(cls):
    """bf16, resumed in fp32, resumed in bf16: the fp32 run kept the loaded fp32 masters
    unchanged and saved them again, and the bf16 resume stepped from them instead of from the
    weights the fp32 run had trained."""
    kw = dict(freeze_step=5) if cls is OnebitAdam else dict(var_freeze_step=5)
    low = torch.nn.Parameter(torch.ones(64, dtype=torch.bfloat16))
    opt = cls([low], lr=1e-2, backend="local", **kw)
    for _ in range(3):
        low.grad = torch.ones_like(low)
        opt.step()
    assert "master" in opt.state_dict()["state"][0]
    full = torch.nn.Parameter(low.detach().float())
    resumed = cls([full], lr=1e-2, backend="local", **kw)
    resumed.load_state_dict(opt.state_dict())
    assert "master" not in resumed.state[full]
    for _ in range(3):
        full.grad = -torch.ones_like(full)
        resumed.step()
    assert "master" not in resumed.state_dict()["state"][0]
    again = torch.nn.Parameter(full.detach().to(torch.bfloat16))
    last = cls([again], lr=1e-2, backend="local", **kw)
    last.load_state_dict(resumed.state_dict())
    again.grad = torch.zeros_like(again)
    last.step()
    assert torch.allclose(again.detach().float(), full.detach(), atol=2e-2)


# ------------------------------------------------------------------ resumed under another schedule

FREEZE_SETTING = {"ZeroOneAdam": "var_freeze_step", "OnebitAdam": "freeze_step", "OnebitLamb": "freeze_step"}


def build(name: str, model: torch.nn.Module, freeze: int) -> torch.optim.Optimizer:
    """`name` over 4 gloo ranks, the variance frozen at step `freeze` (ZeroOneAdam: SCHEDULE's other settings)."""
    if name == "ZeroOneAdam":
        return make_zeroone(model, var_freeze_step=freeze)
    cls = {"OnebitAdam": OnebitAdam, "OnebitLamb": OnebitLamb}[name]
    return cls(model.parameters(), lr=1e-2, freeze_step=freeze, backend=compcomm.backends.get("gloo", group=group(4)))


def resumed_with_another_freeze(
    name: str, saved_at: int, freeze: int, steps: int
) -> tuple[tuple[str, str] | None, int, bytes | None, bytes]:
    """Saved per rank after `saved_at` steps with the variance frozen at step 12, loaded into an
    optimizer that freezes it at `freeze`: what the load raised, the step count after it, the
    weights after `steps` steps in all and those of a straight run frozen at `freeze` (None and
    nothing if refused)."""
    rank = rank_of(4)
    model = make_model()
    opt = build(name, model, 12)
    for step in range(saved_at):
        backward(model, rank, step)
        opt.step()
    saved = through_a_file({"model": model.state_dict(), "opt": opt.state_dict()})
    model = make_model()
    model.load_state_dict(saved["model"])
    opt = build(name, model, freeze)
    failure = caught(opt.load_state_dict, saved["opt"])
    count = opt.step_count
    if failure is not None:
        return failure, count, None, b""
    for step in range(saved_at, steps):
        backward(model, rank, step)
        opt.step()
    resumed = raw(model)
    model = make_model()
    opt = build(name, model, freeze)
    for step in range(steps):
        backward(model, rank, step)
        opt.step()
    return failure, count, resumed, raw(model)


@pytest.mark.parametrize(
    "name,saved_at,freeze",
    [
        ("ZeroOneAdam", 21, 50),  # between syncs of local steps: the ranks' weights were never reconciled
        ("ZeroOneAdam", 5, 3),  # the frozen stage without what the freeze forms: KeyError 'lr_sum' at step 6
        ("OnebitLamb", 5, 5),  # the same: KeyError 'coeff_frozen' at step 6
        ("OnebitAdam", 20, 15),  # v frozen at step 12, bias-corrected as of step 15: a silently other update
    ],
)
def test_a_state_resumed_with_the_freeze_on_its_other_side_is_refused_on_every_rank(pool, name, saved_at, freeze):
    setting = FREEZE_SETTING[name]
    for failure, count, resumed, _ in pool.run(resumed_with_another_freeze, name, saved_at, freeze, saved_at + 4):
        assert failure is not None and failure[0] == "ValueError", failure
        assert f"{setting}=12" in failure[1] and f"{setting}={freeze}" in failure[1], failure
        assert count == 0 and resumed is None  # nothing loaded


@pytest.mark.parametrize("name", ["ZeroOneAdam", "OnebitAdam", "OnebitLamb"])
def test_a_state_saved_before_the_freeze_resumes_under_a_nearer_freeze_as_if_run_so(pool, name):
    """Steps 1-5 are the same stage under a freeze at 12 or at 8: resumed at 5 with 8, the run
    is bit for bit the one that froze at 8 from the start."""
    for failure, _, resumed, straight in pool.run(resumed_with_another_freeze, name, 5, 8, 14):
        assert failure is None, failure
        assert resumed == straight


def mid_interval_at_learning_rate_zero(gathered: bool) -> tuple[bytes, bytes]:
    """The local step 17 (between the syncs at 16 and 18) at learning rate 0 moves each rank's
    momentum and no weight; saved after it, straight and resumed weights at step 20."""
    rank = rank_of(4)

    def run(model: torch.nn.Module, opt: ZeroOneAdam, steps: range) -> None:
        for step in steps:
            for g in opt.param_groups:
                g["lr"] = 0.0 if step + 1 == 17 else 1e-2
            backward(model, rank, step)
            opt.step()

    model = make_model()
    opt = make_zeroone(model)
    run(model, opt, range(20))
    straight = raw(model)
    model = make_model()
    opt = make_zeroone(model)
    run(model, opt, range(17))
    state = {"model": model.state_dict(), "opt": opt.gathered_state_dict() if gathered else opt.state_dict()}
    saved = from_rank0(state) if gathered else through_a_file(state)  # gathered: rank 0's file everywhere
    model = make_model()
    model.load_state_dict(saved["model"])
    opt = make_zeroone(model)
    opt.load_state_dict(saved["opt"])
    run(model, opt, range(17, 20))
    return straight, raw(model)


def gathered_after_a_reset_between_syncs() -> tuple[bool, bytes, bytes]:
    """Per-rank files saved after the local step 17, loaded on the same ranks as
    drop_error_feedback copies (which hold no rank's part); gathered_state_dict() right after,
    loaded everywhere from rank 0's file: whether that file carries every rank's part, and the
    weights at step 20 resumed from it and continued straight."""
    rank = rank_of(4)
    model = make_model()
    opt = make_zeroone(model)
    for step in range(17):
        backward(model, rank, step)
        opt.step()
    saved = through_a_file({"model": model.state_dict(), "opt": opt.state_dict()})
    model = make_model()
    model.load_state_dict(saved["model"])
    opt = make_zeroone(model)
    opt.load_state_dict(ZeroOneAdam.drop_error_feedback(saved["opt"]))
    shared = from_rank0({"model": model.state_dict(), "opt": opt.gathered_state_dict()})
    carried = all(part["rank_local"] for part in shared["opt"]["compcomm"]["ranks"])
    runs = []
    for resume in (False, True):
        if resume:
            model = make_model()
            model.load_state_dict(shared["model"])
            opt = make_zeroone(model)
            opt.load_state_dict(shared["opt"])
        for step in range(17, 20):
            backward(model, rank, step)
            opt.step()
        runs.append(raw(model))  # first straight on from the reset, then resumed from the gathered file
    return carried, runs[0], runs[1]


def test_a_gathered_file_after_a_reset_between_syncs_keeps_every_ranks_part(pool):
    """drop_error_feedback's copy of a per-rank file saved between syncs left the ranks between
    syncs (each with its own weights and momenta) but said it had not: the next gathered file
    held no rank's part, and every rank resumed from rank 0's."""
    for carried, straight, resumed in pool.run(gathered_after_a_reset_between_syncs):
        assert carried
        assert straight == resumed


@pytest.mark.parametrize("gathered", [False, True])
def test_resumes_bit_for_bit_between_syncs_at_learning_rate_zero(pool, gathered):
    """The local part was saved only when the learning rates summed since the sync were
    non-zero: one file from gathered_state_dict() then gave every rank rank 0's momentum."""
    for straight, resumed in pool.run(mid_interval_at_learning_rate_zero, gathered):
        assert straight == resumed


def test_a_sync_interval_doubles_after_a_resume_with_a_smaller_local_step_scaler():
    """Resumed with local_step_scaler below the saved counter, the interval doubled never again
    (the counter was compared with ==)."""
    model = make_model()
    opt = ZeroOneAdam(model.parameters(), backend="local", **SCHEDULE)
    for step in range(14):  # phase 2 from step 13: local_counter 2
        backward(model, 0, step)
        opt.step()
    assert (opt.local_counter, opt.local_interval) == (2, 1)
    resumed = ZeroOneAdam(model.parameters(), backend="local", **{**SCHEDULE, "local_step_scaler": 1})
    resumed.load_state_dict(opt.state_dict())
    intervals = []
    for step in range(14, 17):
        backward(model, 0, step)
        resumed.step()
        intervals.append(resumed.local_interval)
    assert intervals == [2, 4, 4]  # clipped at local_step_clipper


def refused_load_between_backward_and_step(name: str) -> tuple[tuple[str, str] | None, bytes, bytes]:
    """A load refused after a backward has started the step's collectives (rank 1's file is no
    compcomm state), then step(): the load drops the round in flight, and the step must still
    be the one a run without the load takes."""
    rank = rank_of(4)
    runs, failure = [], None
    for load in (False, True):
        model = make_model()
        opt = build(name, model, 3)
        for step in range(6):
            backward(model, rank, step)
            if load and step == 4:
                saved = opt.state_dict()
                if rank == 1:
                    del saved["compcomm"]
                failure = caught(opt.load_state_dict, saved)
            opt.step()
        runs.append(raw(model))
    return failure, runs[0], runs[1]


@pytest.mark.parametrize("name", ["ZeroOneAdam", "OnebitAdam"])
def test_a_load_refused_between_backward_and_step_changes_no_step(pool, name):
    for failure, straight, with_load in pool.run(refused_load_between_backward_and_step, name):
        assert failure is not None and failure[0] == "ValueError", failure
        assert straight == with_load

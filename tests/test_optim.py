"""compcomm.optim on real gloo ranks: both stages, identity across ranks, checkpoints, NaN skips."""

from __future__ import annotations

import io
import math
import re

import pytest
import torch
from torch.optim.lr_scheduler import OneCycleLR

import compcomm
from compcomm.optim import OnebitAdam, OnebitLamb, OnebitOptimizer

from rankpool import caught, group

OPTIMIZERS = {"adam": OnebitAdam, "lamb": OnebitLamb}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


# ------------------------------------------------------------------ helpers run inside ranks


def make_model(dtype: str = "float32") -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    return model.to(DTYPES[dtype])


def batch(rank: int, step: int, dtype: str = "float32") -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_007 * step + rank)
    x = torch.randn(16, 8, generator=g)
    y = x[:, :4] * 0.5 - x[:, 4:] ** 2 * 0.1 + 0.05 * torch.randn(16, 4, generator=g)
    return x.to(DTYPES[dtype]), y.to(DTYPES[dtype])


def backward(model: torch.nn.Module, rank: int, step: int, dtype: str = "float32") -> float:
    model.zero_grad(set_to_none=True)
    x, y = batch(rank, step, dtype)
    loss = torch.nn.functional.mse_loss(model(x).float(), y.float())
    loss.backward()
    return loss.item()


def make_optimizer(name: str, model: torch.nn.Module, world: int, freeze_step: int, **kw) -> OnebitOptimizer:
    backend = compcomm.backends.get("gloo", group=group(world))
    kw.setdefault("lr", 1e-2)
    return OPTIMIZERS[name](model.parameters(), freeze_step=freeze_step, backend=backend, **kw)


def raw(model: torch.nn.Module) -> bytes:
    return b"".join(p.detach().contiguous().view(torch.uint8).numpy().tobytes() for p in model.parameters())


def rank_of(world: int) -> int:
    import torch.distributed as dist

    return dist.get_rank(group(world))


def train(name: str, dtype: str, steps: int, freeze_step: int, weight_decay: float) -> list[bytes]:
    """Parameters' raw bytes after every step, each rank with its own data."""
    rank = rank_of(4)
    model = make_model(dtype)
    opt = make_optimizer(name, model, 4, freeze_step, weight_decay=weight_decay)
    out = []
    for step in range(steps):
        backward(model, rank, step, dtype)
        opt.step()
        out.append(raw(model))
    assert opt.step_count == steps and opt.compressing == (steps >= freeze_step)
    if steps > freeze_step:
        assert all(ef.initialized for ef in opt.error_feedback)
    return out


# ------------------------------------------------------------------ identity across ranks


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_parameters_bitwise_identical_in_both_stages(pool, name, dtype):
    per_rank = pool.run(train, name, dtype, 8, 3, 0.01)
    for step in range(8):
        assert len({r[step] for r in per_rank}) == 1, f"ranks differ after step {step + 1}"
    assert len({per_rank[0][s] for s in range(8)}) == 8, "parameters did not move every step"


# ------------------------------------------------------------------ warm-up = plain Adam


def warmup_against_torch(weight_decay: float, steps: int) -> float:
    rank = rank_of(4)
    model, ref = make_model(), make_model()
    opt = make_optimizer("adam", model, 4, 1000, weight_decay=weight_decay, lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=weight_decay, foreach=False)
    worst = 0.0
    for step in range(steps):
        backward(model, rank, step)
        opt.step()
        grads = [torch.zeros_like(p) for p in ref.parameters()]
        for r in range(4):  # the exact mean gradient, computed locally from every rank's batch
            backward(ref, r, step)
            for acc, p in zip(grads, ref.parameters()):
                acc += p.grad / 4
        for p, g in zip(ref.parameters(), grads):
            p.grad = g
        ref_opt.step()
        for a, b in zip(model.parameters(), ref.parameters()):
            worst = max(worst, float((a - b).abs().max() / b.abs().max()))
    return worst


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_warmup_step_is_adam_on_the_averaged_gradient(pool, weight_decay):
    assert max(pool.run(warmup_against_torch, weight_decay, 5)) < 1e-5


def lamb_warmup_reference(weight_decay: float, steps: int) -> float:
    """LAMB warm-up steps of one parameter against the formula written out in float64."""
    rank = rank_of(4)
    torch.manual_seed(1)
    w0 = torch.randn(10)
    p = torch.nn.Parameter(w0.clone())
    opt = OnebitLamb(
        [p], lr=0.1, weight_decay=weight_decay, freeze_step=100, backend=compcomm.backends.get("gloo", group=group(4))
    )
    w, m, v = w0.double(), torch.zeros(10, dtype=torch.float64), torch.zeros(10, dtype=torch.float64)
    for t in range(1, steps + 1):
        grads = [torch.randn(10, generator=torch.Generator().manual_seed(100 * t + r)) for r in range(4)]
        p.grad = grads[rank].clone()
        opt.step()
        g = sum(x.double() for x in grads) / 4
        m, v = 0.9 * m + 0.1 * g, 0.999 * v + 0.001 * g * g
        u = (m / (1 - 0.9**t)) / ((v / (1 - 0.999**t)).sqrt() + 1e-8) + weight_decay * w
        c = min(max(float(w.norm() / u.norm()), 0.01), 10.0)
        w = w - 0.1 * c * u
    return float((p.detach().double() - w).abs().max())


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_lamb_warmup_step_matches_formula(pool, weight_decay):
    assert max(pool.run(lamb_warmup_reference, weight_decay, 3)) < 1e-5


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_lamb_compressed_update_matches_formula(weight_decay):
    """One compression-stage update of 1-bit LAMB, given the averaged momentum m, against the
    formula of compcomm/optim/lamb.py's docstring written out in float64."""
    torch.manual_seed(3)
    p = torch.nn.Parameter(torch.randn(50))
    opt = OnebitLamb([p], lr=0.05, weight_decay=weight_decay, freeze_step=2, backend="local")
    for _ in range(2):  # warm-up; the second step freezes
        p.grad = torch.randn(50)
        opt.step()
    state, group = opt.state[p], opt.param_groups[0]
    w0, m_prev, v = p.detach().double().clone(), state["exp_avg"].double(), state["exp_avg_sq"].double()
    fresh0, last, frozen = state["exp_avg_sq_fresh"].double(), state["last_factor"], state["coeff_frozen"]
    m, t, (b1, b2), eps = torch.randn(50), 3, group["betas"], group["eps"]
    opt._compressed_update(t, p, m.clone(), group, state)
    g = (m.double() - b1 * m_prev) / (1 - b1)
    fresh = b2 * fresh0 + (1 - b2) * g * g
    d = (v / (1 - b2**2)).sqrt() + eps
    f = float((d / ((fresh / (1 - b2**t)).sqrt() + eps)).max())
    u_pre = (m.double() / (1 - b1**t)) / d
    u = u_pre + weight_decay * w0
    if weight_decay:
        r = min(1.0, float(u_pre.norm() / u.norm()))
        f = r * f + (1 - r)
    f = min(max(f, 0.5), 4.0)  # factor_min, factor_max
    f = min(max(f, last * 0.9), last * 1.1)  # factor_threshold around the last factor
    c = min(max(frozen * f, 0.01), 10.0)
    expected = w0 - 0.05 * c * u
    assert float((p.detach().double() - expected).abs().max() / expected.abs().max()) < 1e-6
    assert torch.equal(state["exp_avg"], m) and state["last_factor"] == pytest.approx(f, rel=1e-6)


# ------------------------------------------------------------------ checkpoints


def scheduler_for(opt: torch.optim.Optimizer, steps: int, scheduled: bool) -> OneCycleLR | None:
    """OneCycleLR (it moves the learning rate and betas[0] at every step), or None."""
    return OneCycleLR(opt, max_lr=0.01, total_steps=steps) if scheduled else None


def straight_vs_resumed(
    name: str, steps: int, stop: int, freeze_step: int, scheduled: bool = False
) -> tuple[bytes, bytes, bytes, bytes]:
    rank = rank_of(4)
    model = make_model()
    opt = make_optimizer(name, model, 4, freeze_step, weight_decay=0.01)
    scheduler = scheduler_for(opt, steps, scheduled)
    for step in range(steps):
        backward(model, rank, step)
        opt.step()
        if scheduler is not None:
            scheduler.step()
    straight = raw(model)
    straight_ef = b"".join(
        ef.worker_error.numpy().tobytes() + ef.server_error.numpy().tobytes()
        for ef in opt.error_feedback
        if ef.initialized
    )

    model = make_model()
    opt = make_optimizer(name, model, 4, freeze_step, weight_decay=0.01)
    scheduler = scheduler_for(opt, steps, scheduled)
    for step in range(stop):
        backward(model, rank, step)
        opt.step()
        if scheduler is not None:
            scheduler.step()
    buf = io.BytesIO()
    schedule = None if scheduler is None else scheduler.state_dict()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "scheduler": schedule}, buf)
    for p in model.parameters():  # make sure nothing survives but the checkpoint
        p.data.fill_(123.0)
    del model, opt

    saved = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
    model = make_model()
    model.load_state_dict(saved["model"])
    opt = make_optimizer(name, model, 4, freeze_step, weight_decay=0.01)
    scheduler = scheduler_for(opt, steps, scheduled)
    opt.load_state_dict(saved["opt"])
    if scheduler is not None:
        scheduler.load_state_dict(saved["scheduler"])
    assert opt.step_count == stop
    for step in range(stop, steps):
        backward(model, rank, step)
        opt.step()
        if scheduler is not None:
            scheduler.step()
    resumed_ef = b"".join(
        ef.worker_error.numpy().tobytes() + ef.server_error.numpy().tobytes()
        for ef in opt.error_feedback
        if ef.initialized
    )
    return straight, raw(model), straight_ef, resumed_ef


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("stage,freeze_step", [("warmup", 100), ("at_freeze", 4), ("compression", 2)])
def test_state_dict_resumes_bit_for_bit(pool, name, stage, freeze_step):
    for straight, resumed, ef_a, ef_b in pool.run(straight_vs_resumed, name, 8, 4, freeze_step):
        assert straight == resumed
        assert ef_a == ef_b


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_state_dict_resumes_bit_for_bit_under_a_scheduler(pool, name):
    """The loaded groups' settings, which a scheduler moves from step to step, are the ones the
    resumed run uses (the payloads read them too: the momentum's beta1, 0/1 Adam's lr)."""
    for straight, resumed, ef_a, ef_b in pool.run(straight_vs_resumed, name, 8, 4, 2, True):
        assert straight == resumed
        assert ef_a == ef_b


def save_on_four(name: str) -> bytes:
    rank = rank_of(4)
    model = make_model()
    opt = make_optimizer(name, model, 4, 2)
    for step in range(4):
        backward(model, rank, step)
        opt.step()
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    return buf.getvalue()


def load_on_two(name: str, blob: bytes):
    rank = rank_of(2)
    model = make_model()
    opt = make_optimizer(name, model, 2, 2)
    saved = torch.load(io.BytesIO(blob), weights_only=False)
    failure = caught(opt.load_state_dict, saved)
    opt = make_optimizer(name, model, 2, 2)
    opt.load_state_dict(OnebitOptimizer.drop_error_feedback(saved))
    backward(model, rank, 4)
    opt.step()
    return failure, opt.step_count, raw(model)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_other_world_size_is_a_clear_error_or_an_explicit_reset(pool, name):
    blob = pool.run(save_on_four, name)[0]
    results = pool.run(load_on_two, name, blob, ranks=[0, 1])
    for failure, steps, _ in results:
        assert failure is not None and failure[0] == "ValueError"
        assert "saved on 4 ranks" in failure[1] and "2" in failure[1]
        assert steps == 5
    assert results[0][2] == results[1][2]


def test_state_dict_of_other_parameters_is_rejected():
    model = make_model()
    opt = OnebitAdam(model.parameters(), freeze_step=2, backend="local")
    sd = opt.state_dict()
    other = OnebitAdam(torch.nn.Linear(3, 3).parameters(), freeze_step=2, backend="local")
    with pytest.raises(ValueError):
        other.load_state_dict(sd)


# ------------------------------------------------------------------ non-finite gradients


def snapshot(model: torch.nn.Module, opt: OnebitOptimizer) -> bytes:
    parts = [raw(model), str(opt.step_count).encode()]
    for p in model.parameters():
        for k, v in sorted(opt.state[p].items()):
            parts.append(k.encode() + (v.numpy().tobytes() if torch.is_tensor(v) else repr(v).encode()))
    for ef in opt.error_feedback:
        if ef.initialized:
            parts.append(ef.worker_error.numpy().tobytes() + ef.server_error.numpy().tobytes())
    return b"|".join(parts)


def nan_on_one_rank(name: str, bad_step: int, bad_rank: int, value: float) -> tuple[bool, bool, bytes, bytes]:
    """Train 7 steps; at `bad_step` rank `bad_rank` has a non-finite gradient (that step is
    then retried with a clean one). Returns (skipped, unchanged, final params, clean-run params)."""
    rank = rank_of(4)
    model = make_model()
    opt = make_optimizer(name, model, 4, 3)
    skipped = unchanged = False
    for step in range(7):
        if step == bad_step:
            backward(model, rank, step)
            if rank == bad_rank:
                next(model.parameters()).grad.view(-1)[3] = value
            before = snapshot(model, opt)
            opt.step()
            skipped, unchanged = opt.last_step_skipped, snapshot(model, opt) == before
        backward(model, rank, step)
        opt.step()
        assert not opt.last_step_skipped
    clean_model = make_model()
    clean = make_optimizer(name, clean_model, 4, 3)
    for step in range(7):
        backward(clean_model, rank, step)
        clean.step()
    return skipped, unchanged, raw(model), raw(clean_model)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("bad_step,value", [(1, math.nan), (5, math.inf)])
def test_non_finite_gradient_skips_the_step_on_every_rank(pool, name, bad_step, value):
    for skipped, unchanged, final, clean in pool.run(nan_on_one_rank, name, bad_step, 2, value):
        assert skipped and unchanged
        assert final == clean


# ------------------------------------------------------------------ collectives per bucket


def count_collectives(name: str) -> list[dict]:
    rank = rank_of(4)
    model = make_model()
    opt = make_optimizer(name, model, 4, 2)
    opt.bucket_bytes = 200  # 4 fp32 parameters of 128, 16, 64 and 4 elements -> several buckets
    be = opt.backend
    counts = {"all_reduce": 0, "all_gather": 0, "all_to_all": 0}
    kinds = {**{op: op for op in counts}, "all_gather_arriving": "all_gather"}  # phase 2 hands rows over as they come
    for method, op in kinds.items():
        original = getattr(be, method)

        def counted(*a, _op=op, _original=original, **k):
            counts[_op] += 1
            return _original(*a, **k)

        setattr(be, method, counted)
    per_step = []
    try:
        for step in range(4):  # a step's collectives start during its backward (overlap)
            for op in counts:
                counts[op] = 0
            sent = be.bytes_sent
            backward(model, rank, step)
            opt.step()
            per_step.append(dict(counts, buckets=len(opt.error_feedback), bytes=be.bytes_sent - sent))
    finally:
        for method in kinds:
            delattr(be, method)
    return per_step


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_one_collective_per_bucket(pool, name):
    numel = sum(p.numel() for p in make_model().parameters())
    for per_step in pool.run(count_collectives, name):
        buckets = per_step[0]["buckets"]
        assert buckets >= 3
        for t, warm in enumerate(per_step[:2]):  # flag + one uncompressed all-reduce per bucket, and at the
            # first step one all-gather: do the ranks start from the same parameters?
            assert (warm["all_reduce"], warm["all_gather"], warm["all_to_all"]) == (1 + buckets, int(t == 0), 0)
        for comp in per_step[2:]:  # flag + one compressed allreduce per bucket: its phase-0 all-to-all,
            # a phase-1 all-to-all when phase 0 had no room for all its signs, one phase-2 all-gather
            assert (comp["all_reduce"], comp["all_gather"]) == (1, buckets)
            assert buckets <= comp["all_to_all"] <= 2 * buckets
        assert per_step[0]["bytes"] >= 2 * 3 / 4 * 4 * numel
        assert per_step[3]["bytes"] < per_step[0]["bytes"] / 3


def settings_differ(name: str, setting: str) -> tuple:
    """Rank 3 passes another freeze_step (or lr) than the others; step 1 compares them."""
    rank = rank_of(4)
    model = make_model()
    freeze_step, lr = (
        (3 if setting == "freeze_step" and rank == 3 else 2),
        (2e-2 if setting == "lr" and rank == 3 else 1e-2),
    )
    opt = make_optimizer(name, model, 4, freeze_step, lr=lr)
    backward(model, rank, 0)
    before = raw(model)
    return caught(opt.step), opt.step_count, raw(model) == before


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("setting", ["freeze_step", "lr"])
def test_settings_that_differ_across_ranks_raise_on_every_rank(pool, name, setting):
    """A freeze_step that differs hung every rank from the first compressed step on (one rank sent
    its gradients exactly, another its momentum with 1 bit); an lr that differs let the
    parameters drift apart. Now step 1 raises the same ValueError everywhere, nothing changed."""
    for failure, steps, unchanged in pool.run(settings_differ, name, setting):
        assert failure is not None and failure[0] == "ValueError", failure
        named = "freeze_step" if setting == "freeze_step" else "param_groups[0].lr"
        assert f"ranks passed different {named} " in failure[1], failure
        assert steps == 0 and unchanged


def saved_after_one_step(name: str) -> tuple[torch.nn.Module, dict]:
    """A model and this rank's state of optimizer `name` (freeze_step 2) after one step."""
    model = make_model()
    opt = make_optimizer(name, model, 4, 2)
    backward(model, rank_of(4), 0)
    opt.step()
    return model, opt.state_dict()


def settings_differ_after_resume(name: str) -> tuple:
    """Every rank saves after one step; rank 3 resumes into an optimizer with another freeze_step
    (the schedule is the object's, not the checkpoint's)."""
    model, saved = saved_after_one_step(name)
    resumed = make_optimizer(name, model, 4, 3 if rank_of(4) == 3 else 2)
    return caught(resumed.load_state_dict, saved), resumed.step_count


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_freeze_step_that_differs_after_a_resume_raises_on_every_rank(pool, name):
    """It passed the load and hung every rank at the first step where the schedules parted."""
    for failure, steps in pool.run(settings_differ_after_resume, name):
        assert failure is not None and failure[0] == "ValueError", failure
        assert "ranks passed different freeze_step" in failure[1], failure
        assert steps == 0


# ------------------------------------------------------------------ hyperparameters, dtypes, world 1


@pytest.mark.parametrize(
    "cls,kw",
    [
        (OnebitAdam, dict(lr=-1.0)),
        (OnebitAdam, dict(eps=-1e-8)),
        (OnebitAdam, dict(betas=(1.0, 0.999))),
        (OnebitAdam, dict(betas=(0.9, -0.1))),
        (OnebitAdam, dict(betas=(0.9,))),
        (OnebitAdam, dict(weight_decay=-0.1)),
        (OnebitAdam, dict(freeze_step=0)),
        (OnebitAdam, dict(freeze_step=2.5)),
        (OnebitAdam, dict(lr=math.nan)),
        (OnebitLamb, dict(max_coeff=0.001)),
        (OnebitLamb, dict(min_coeff=0.0)),
        (OnebitLamb, dict(coeff_beta=1.0)),
        (OnebitLamb, dict(factor_max=0.5)),
        (OnebitLamb, dict(factor_min=2.0)),
        (OnebitLamb, dict(factor_min=0.0)),
        (OnebitLamb, dict(factor_threshold=-0.1)),
        (OnebitLamb, dict(lr=-1.0)),
    ],
)
def test_invalid_hyperparameters_raise_value_error(cls, kw):
    with pytest.raises(ValueError):
        cls(torch.nn.Linear(2, 2).parameters(), **kw)


def test_a_tensor_learning_rate_is_refused_for_being_a_tensor():
    """torch's AdamW takes a tensor lr; these optimizers take numbers, and said that
    tensor(0.0010) "must be a finite number", which it is (from a probe)."""
    with pytest.raises(ValueError, match=re.escape("invalid lr: tensor(0.0010) (a Tensor is not taken: must be")):
        OnebitAdam(torch.nn.Linear(2, 2).parameters(), lr=torch.tensor(1e-3))


def test_invalid_param_group_and_dtype_raise_value_error():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError):
        OnebitAdam([{"params": [model.weight], "lr": -1.0}, {"params": [model.bias]}])
    with pytest.raises(ValueError):
        OnebitAdam(torch.nn.Linear(2, 2).double().parameters())
    with pytest.raises(ValueError, match="exp_avg_mask must be a tensor broadcastable"):  # was torch's RuntimeError
        OnebitAdam([{"params": [model.weight], "exp_avg_mask": torch.ones(3)}])


def a_file_with_an_invalid_group(name: str, change: dict) -> tuple:
    """Every rank's file holds a parameter group changed by `change` alike (as one gathered file
    would), so the ranks agree on it: torch's load took it as saved, and an lr < 0 then stepped
    uphill without a word, a beta >= 1 or a mask of another shape failed at a later step."""
    model, saved = saved_after_one_step(name)
    saved["param_groups"][0].update(change)
    resumed = make_optimizer(name, model, 4, 2)
    failure = caught(resumed.load_state_dict, saved)
    return failure, resumed.step_count, resumed.param_groups[0]["lr"]


@pytest.mark.parametrize(
    "name,change,says",
    [
        ("adam", {"lr": -1.0}, "invalid lr: -1.0"),
        ("adam", {"betas": (0.9, 2.0)}, "invalid betas[1]: 2.0"),
        ("adam", {"exp_avg_mask": torch.ones(3)}, "exp_avg_mask must be a tensor broadcastable"),
        ("lamb", {"min_coeff": 0.0}, "invalid min_coeff: 0.0"),
    ],
)
def test_a_file_with_an_invalid_group_is_refused_on_every_rank(pool, name, change, says):
    for failure, steps, lr in pool.run(a_file_with_an_invalid_group, name, change):
        assert failure is not None and failure[0] == "ValueError", failure
        assert "rank 0: the checkpoint's parameter group 0: " + says in failure[1], failure
        assert steps == 0 and lr == 1e-2


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_single_process_both_stages_and_fp32_state(name, dtype):
    model = make_model(dtype)
    opt = OPTIMIZERS[name](model.parameters(), lr=1e-2, freeze_step=3, backend="local")
    losses = []
    for step in range(40):
        losses.append(backward(model, 0, step % 4, dtype))
        opt.step()
    assert opt.step_count == 40 and losses[-1] < losses[0]
    for p in model.parameters():
        assert p.dtype == DTYPES[dtype]
        assert all(v.dtype == torch.float32 for v in opt.state[p].values() if torch.is_tensor(v))


# ------------------------------------------------------------------ convergence, briefly


def regression_run(name: str, freeze_step: int, steps: int) -> tuple[float, int]:
    """Fit a random 2-layer teacher through label noise (each rank its own samples); the final
    loss on held-out noisy data (floor: the noise variance 0.09)."""
    rank = rank_of(4)
    torch.manual_seed(0)
    teacher = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    torch.manual_seed(1)
    student = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    opt = make_optimizer(name, student, 4, freeze_step, lr=3e-3)
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        x = torch.randn(32, 16, generator=gen)
        with torch.no_grad():
            y = teacher(x) + 0.3 * torch.randn(32, 4, generator=gen)  # a noise floor of 0.09
        student.zero_grad()
        torch.nn.functional.mse_loss(student(x), y).backward()
        opt.step()
    held_out = torch.Generator().manual_seed(999)
    x = torch.randn(2048, 16, generator=held_out)
    with torch.no_grad():
        y = teacher(x) + 0.3 * torch.randn(2048, 4, generator=held_out)
        return float(torch.nn.functional.mse_loss(student(x), y)), opt.backend.bytes_sent


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_short_convergence_close_to_uncompressed(pool, name):
    steps = 200
    base_loss, base_bytes = pool.run(regression_run, name, steps + 1, steps)[0]
    onebit_loss, onebit_bytes = pool.run(regression_run, name, steps * 15 // 100, steps)[0]
    initial = pool.run(regression_run, name, 1, 0)[0][0]
    assert base_loss < 0.3 * initial, "the uncompressed baseline did not learn"
    print(name, initial, base_loss, onebit_loss, base_bytes / onebit_bytes)
    assert onebit_loss <= base_loss * 1.03, (onebit_loss, base_loss)
    assert base_bytes / onebit_bytes > 4.0

"""OnebitAdam and OnebitLamb on FSDP2-sharded parameters under compcomm.fsdp.compress, on real
gloo ranks: each step's parameters (gathered from the shards) against the same update rules
applied to whole tensors with FSDP's reduced gradients; replicas bitwise equal under HSDP;
checkpoints; and the misuses that must be clear errors on every rank."""

from __future__ import annotations

import io

import pytest
import torch

import compcomm
from compcomm.optim import OnebitAdam, OnebitLamb, ZeroOneAdam
from compcomm.optim.base import COMPRESSED

from fsdp_models import NEEDS_FSDP_SEAMS, batch, full_params, loss_of, make_model, shard
from rankpool import caught, group

pytestmark = NEEDS_FSDP_SEAMS

OPTIMIZERS = {"adam": OnebitAdam, "lamb": OnebitLamb}
FREEZE = 2


def _optimizer(name: str, params, **extra):
    return OPTIMIZERS[name](params, lr=0.01, weight_decay=0.01, freeze_step=FREEZE, **extra)


def _groups(model: torch.nn.Module, masked: bool) -> list[dict]:
    """All parameters in one group; or the first Linear's weight (7 rows over 4 ranks: 2, 2, 2, 1)
    in a group of its own with an `exp_avg_mask` shaped like the whole weight."""
    params = list(model.parameters())
    if not masked:
        return [{"params": params}]
    mask = (torch.rand(7, 5, generator=torch.Generator().manual_seed(3)) > 0.3).float()
    return [{"params": params[:1], "exp_avg_mask": mask}, {"params": params[1:]}]


def sharded_run(name: str, steps: int, masked: bool = False) -> dict:
    """The sharded run, and on every rank the same rules on whole tensors fed FSDP's reduced
    gradients (gathered from the shards): warm-up steps through step(), and after the freeze
    the momentum formed from the 1-bit gradient, then the optimizer's compressed update.
    `masked`: a whole-weight exp_avg_mask on one parameter, which the sharded optimizer applied
    to its shard unsliced (a shape error at the first compressed step)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    model = shard(make_model(), (0, 1, 2, 3))
    compcomm.fsdp.compress(model, start_iter=FREEZE)
    opt = _optimizer(name, _groups(model, masked))
    whole = make_model()
    ref = _optimizer(name, _groups(whole, masked), backend="local")
    gaps = []
    for step in range(steps):
        loss_of(model, batch(rank, step)).backward()
        reduced = [p.grad.full_tensor() for p in model.parameters()]
        opt.step()
        opt.zero_grad()
        t = step + 1
        with torch.no_grad():
            if t <= FREEZE:
                for p, g in zip(whole.parameters(), reduced):
                    p.grad = g.clone()
                ref.step()
            else:
                momenta = []
                groups = [group for group in ref.param_groups for _ in group["params"]]
                for p, g, group in zip(whole.parameters(), reduced, groups):
                    m = torch.empty_like(p)
                    ref._payload(t, COMPRESSED, p, group, g, m)
                    momenta.append(m)
                ref._apply(t, COMPRESSED, momenta)
                ref._step_count = t
        got, want = full_params(model), [p.detach() for p in whole.parameters()]
        gaps.append(max(float((a - b).abs().max() / b.abs().max().clamp(min=1e-6)) for a, b in zip(got, want)))
    return {"gaps": gaps, "steps": opt.step_count}


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_sharded_steps_match_the_whole_tensor_rules(pool, name, masked):
    for r in pool.run(sharded_run, name, 5, masked):
        assert r["steps"] == 5
        assert max(r["gaps"]) < 1e-5, r["gaps"]


def alone(name: str) -> tuple[int, bool, bool] | None:
    """Rank 0 alone (a 1-rank mesh, where FSDP reduces nothing): steps past the freeze."""
    import torch.distributed as dist

    if dist.get_rank() != 0:
        return None
    model = shard(make_model(), (0,))
    compcomm.fsdp.compress(model, start_iter=FREEZE)
    opt = _optimizer(name, model.parameters())
    before = full_params(model)
    for step in range(FREEZE + 2):
        loss_of(model, batch(0, step)).backward()
        opt.step()
        opt.zero_grad()
    after = full_params(model)
    moved = all(not torch.equal(a, b) for a, b in zip(before, after))
    return opt.step_count, moved, all(bool(torch.isfinite(p).all()) for p in after)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_one_rank_steps_past_the_freeze(pool, name):
    """FSDP2 skips the reduce-scatter of a 1-rank group, so no backward is counted there: the
    optimizer must not take that for steps out of step with the compression."""
    assert pool.run(alone, name)[0] == (FREEZE + 2, True, True)


def hsdp_run(name: str, steps: int) -> list[bytes]:
    import torch.distributed as dist

    rank = dist.get_rank()
    model = shard(make_model(seed=rank), ((0, 1), (2, 3))[rank // 2])
    compcomm.fsdp.compress(model, start_iter=FREEZE, replicate_group=group(((0, 2), (1, 3))[rank % 2]))
    opt = _optimizer(name, model.parameters())
    out = []
    for step in range(steps):
        loss_of(model, batch(rank, step)).backward()
        opt.step()
        opt.zero_grad()
        out.append(b"".join(p.to_local().detach().numpy().tobytes() for p in model.parameters()))
    return out


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_hsdp_replicas_stay_bitwise_equal(pool, name):
    res = pool.run(hsdp_run, name, 4)
    assert res[0] == res[2] and res[1] == res[3]


def resume(name: str, gathered: bool) -> tuple[bytes, bytes]:
    import torch.distributed as dist

    rank = dist.get_rank()

    def build():
        model = shard(make_model(), (0, 1, 2, 3))
        state = compcomm.fsdp.compress(model, start_iter=FREEZE)
        return model, state, _optimizer(name, model.parameters())

    def train(model, opt, steps):
        for step in steps:
            loss_of(model, batch(rank, step)).backward()
            opt.step()
            opt.zero_grad()

    def raw(model):
        return b"".join(p.to_local().detach().numpy().tobytes() for p in model.parameters())

    model, state, opt = build()
    train(model, opt, range(5))
    straight = raw(model)
    model, state, opt = build()
    train(model, opt, range(3))
    blob = io.BytesIO()
    torch.save(
        {
            "model": [p.to_local().detach().clone() for p in model.parameters()],
            "opt": opt.gathered_state_dict() if gathered else opt.state_dict(),
            "comm": state.state_dict(),
        },
        blob,
    )
    blob.seek(0)
    saved = torch.load(blob, weights_only=False)
    model, state, opt = build()
    with torch.no_grad():
        for p, value in zip(model.parameters(), saved["model"]):
            p.to_local().copy_(value)
    opt.load_state_dict(saved["opt"])
    state.load_state_dict(saved["comm"])
    train(model, opt, range(3, 5))
    return straight, raw(model)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("gathered", [False, True])
def test_checkpoint_resumes_bit_for_bit(pool, name, gathered):
    for straight, resumed in pool.run(resume, name, gathered):
        assert straight == resumed


def foreign(name: str) -> tuple[tuple[str, str] | None, tuple[str, str] | None]:
    """Rank 0's file loaded everywhere; and drop_error_feedback, which gives a rank-independent
    copy of a whole-parameter state, asked of a sharded one (its moments are this rank's shards
    too): a bare KeyError before."""
    import torch.distributed as dist

    rank = dist.get_rank()
    model = shard(make_model(), (0, 1, 2, 3))
    compcomm.fsdp.compress(model, start_iter=FREEZE)
    opt = _optimizer(name, model.parameters())
    loss_of(model, batch(rank, 0)).backward()
    opt.step()
    blob = [opt.state_dict()]
    dist.broadcast_object_list(blob, src=0, group=group(4))
    return caught(opt.load_state_dict, blob[0]), caught(type(opt).drop_error_feedback, opt.state_dict())


def test_rank0_optimizer_state_loaded_everywhere_raises_on_every_rank(pool):
    for failure, dropped in pool.run(foreign, "adam"):
        assert failure is not None and failure[0] == "ValueError" and "shards of rank 0" in failure[1], failure
        assert dropped is not None and dropped[0] == "ValueError" and "FSDP2-sharded" in dropped[1], dropped


def refrozen(name: str) -> tuple[tuple[str, str] | None, int]:
    """A state saved per rank after step 3, past the freeze at step 2, loaded into an optimizer
    (and a compression) that freeze at step 4: v frozen at 2 would be bias-corrected as of 4."""
    import torch.distributed as dist

    rank = dist.get_rank()
    model = shard(make_model(), (0, 1, 2, 3))
    compcomm.fsdp.compress(model, start_iter=FREEZE)
    opt = _optimizer(name, model.parameters())
    for step in range(3):
        loss_of(model, batch(rank, step)).backward()
        opt.step()
        opt.zero_grad()
    saved = opt.state_dict()
    model = shard(make_model(), (0, 1, 2, 3))
    compcomm.fsdp.compress(model, start_iter=FREEZE + 2)
    opt = OPTIMIZERS[name](model.parameters(), lr=0.01, freeze_step=FREEZE + 2)
    return caught(opt.load_state_dict, saved), opt.step_count


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_state_past_the_freeze_resumed_with_another_freeze_step_is_refused_on_every_rank(pool, name):
    for failure, count in pool.run(refrozen, name):
        assert failure is not None and failure[0] == "ValueError", failure
        assert "freeze_step=2" in failure[1] and "freeze_step=4" in failure[1], failure
        assert count == 0


def scaled(name: str) -> dict:
    """GradScaler with nonfinite="propagate": rank 1's loss is inf at the second iteration,
    so every rank's gradients come back NaN, that backward is not counted, and the scaler skips
    the step. The sharded optimizer raised there that the step followed too few backwards."""
    import torch.distributed as dist

    rank = dist.get_rank()
    model = shard(make_model(), (0, 1, 2, 3))
    compcomm.fsdp.compress(model, start_iter=FREEZE, nonfinite="propagate")
    opt = _optimizer(name, model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    for step in range(5):
        loss = loss_of(model, batch(rank, step))
        if step == 1 and rank == 1:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    finite = all(bool(torch.isfinite(p).all()) for p in full_params(model))
    return {"steps": opt.step_count, "skipped": opt.skipped_steps, "scale": scaler.get_scale(), "finite": finite}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_grad_scaler_skips_a_propagated_nonfinite_backward(pool, name):
    for r in pool.run(scaled, name):
        assert r == {"steps": 4, "skipped": 1, "scale": 2.0**7, "finite": True}, r


def misuse(case: str) -> tuple[str, str] | None:
    import torch.distributed as dist

    rank = dist.get_rank()
    model = shard(make_model(), (0, 1, 2, 3))
    if case == "zeroone":
        compcomm.fsdp.compress(model, start_iter=FREEZE)
        return caught(ZeroOneAdam, model.parameters(), var_freeze_step=FREEZE)
    if case == "no_compress":
        opt = OnebitAdam(model.parameters(), freeze_step=FREEZE)
        loss_of(model, batch(rank, 0)).backward()
        return caught(opt.step)
    if case == "freeze_mismatch":
        compcomm.fsdp.compress(model, start_iter=FREEZE + 1)
        opt = OnebitAdam(model.parameters(), freeze_step=FREEZE)
        loss_of(model, batch(rank, 0)).backward()
        return caught(opt.step)
    if case in ("freeze_differs_on_one_rank", "lr_differs_on_one_rank"):  # rank 3 alone raised before
        compcomm.fsdp.compress(model, start_iter=FREEZE)
        setting = "freeze_step" if case == "freeze_differs_on_one_rank" else "lr"
        value = {"freeze_step": FREEZE, "lr": 0.01}[setting] * (2 if rank == 3 else 1)
        opt = OnebitAdam(model.parameters(), **{"freeze_step": FREEZE, "lr": 0.01, setting: value})
        loss_of(model, batch(rank, 0)).backward()
        return caught(opt.step)
    if case == "backend_on_one_rank":  # unused on sharded parameters: it was accepted, unchecked
        compcomm.fsdp.compress(model, start_iter=FREEZE)
        opt = OnebitAdam(model.parameters(), freeze_step=FREEZE, backend="nope" if rank == 1 else None)
        loss_of(model, batch(rank, 0)).backward()
        before = full_params(model)
        failure = caught(opt.step)
        assert opt.step_count == 0 and all(torch.equal(a, b) for a, b in zip(before, full_params(model)))
        return failure
    if case == "two_backwards_per_step":
        compcomm.fsdp.compress(model, start_iter=FREEZE)
        opt = OnebitAdam(model.parameters(), freeze_step=FREEZE)
        loss_of(model, batch(rank, 0)).backward()
        loss_of(model, batch(rank, 1)).backward()
        return caught(opt.step)
    if case == "no_sync":
        compcomm.fsdp.compress(model, start_iter=FREEZE)
        opt = OnebitAdam(model.parameters(), freeze_step=FREEZE)

        def enter():
            with opt.no_sync():
                pass

        return caught(enter)
    raise AssertionError(case)


@pytest.mark.parametrize(
    "case, error, words",
    [
        ("zeroone", "ValueError", "ZeroOneAdam does not run on FSDP2-sharded"),
        ("no_compress", "ValueError", "compcomm.fsdp.compress"),
        ("freeze_mismatch", "ValueError", "must equal the start_iter"),
        ("freeze_differs_on_one_rank", "ValueError", "ranks passed different freeze_step"),
        ("lr_differs_on_one_rank", "ValueError", "ranks passed different param_groups[0].lr"),
        ("backend_on_one_rank", "ValueError", "rank 1: OnebitAdam's backend= is not used on FSDP2-sharded"),
        ("two_backwards_per_step", "ValueError", "set_requires_gradient_sync(False)"),
        ("no_sync", "RuntimeError", "set_requires_gradient_sync(False)"),
    ],
)
def test_misuse_is_a_clear_error_on_every_rank(pool, case, error, words):
    for failure in pool.run(misuse, case):
        assert failure is not None and failure[0] == error and words in failure[1], failure

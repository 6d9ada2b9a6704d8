"""Overlap of the optimizers' communication with backward, on real gloo ranks: bitwise the
non-overlapped result, buckets in order of readiness, collectives during backward, no_sync."""

from __future__ import annotations

import pytest
import torch
from test_optim import OPTIMIZERS, backward, make_optimizer, rank_of, raw


def deeper_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)
    )


def run(name: str, overlap: bool, steps: int, freeze_step: int) -> tuple[list[bytes], list[int]]:
    rank = rank_of(4)
    model = deeper_model()
    opt = make_optimizer(name, model, 4, freeze_step, weight_decay=0.01)
    opt.bucket_bytes = 1200
    opt.overlap = overlap
    out = []
    for step in range(steps):
        model.zero_grad(set_to_none=True)
        g = torch.Generator().manual_seed(step * 7 + rank)
        x = torch.randn(16, 8, generator=g)
        torch.nn.functional.mse_loss(model(x), x[:, :4].sin()).backward()
        opt.step()
        out.append(raw(model))
    return out, list(opt._rounds.lay_out().order)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_overlapped_step_is_bitwise_the_non_overlapped_step(pool, name):
    overlapped = pool.run(run, name, True, 8, 3)
    plain = pool.run(run, name, False, 8, 3)
    for (a, order_a), (b, order_b) in zip(overlapped, plain):
        assert a == b
        assert order_a == order_b
    assert len({r[0][-1] for r in overlapped}) == 1


def order_and_launches(name: str) -> tuple[list[int], list[int], list[int], int]:
    """The bucket order, the order the hooks saw, and per step how many buckets had started
    their collective when backward returned (the first backward only records the order)."""
    rank = rank_of(4)
    model = deeper_model()
    opt = make_optimizer(name, model, 4, 2)
    opt.bucket_bytes = 1200
    started = []
    for step in range(4):
        backward(model, rank, step)
        started.append(len(opt._rounds.round.launches) if opt._rounds.round is not None else 0)
        opt.step()
    return list(opt._rounds.lay_out().order), list(opt._rounds.readiness.order), started, len(opt.error_feedback)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_buckets_follow_readiness_and_start_during_backward(pool, name):
    for order, seen, started, buckets in pool.run(order_and_launches, name):
        assert order == seen
        assert order[0] == 5  # the last layer's bias is ready first
        assert buckets >= 3 and started == [0, buckets, buckets, buckets]


def accumulate(name: str, micro: int, use_no_sync: bool) -> tuple[bytes, int]:
    """Each step accumulates `micro` backward passes; with no_sync only the last communicates."""
    rank = rank_of(4)
    model = deeper_model()
    opt = make_optimizer(name, model, 4, 2)
    opt.bucket_bytes = 1200
    opt.overlap = use_no_sync
    be = opt.backend
    sent_in_no_sync = 0
    for step in range(5):
        model.zero_grad(set_to_none=True)
        for k in range(micro):
            g = torch.Generator().manual_seed(100 * step + 10 * k + rank)
            x = torch.randn(16, 8, generator=g)
            loss = torch.nn.functional.mse_loss(model(x), x[:, :4].cos())
            if use_no_sync and k < micro - 1:
                before = be.bytes_sent
                with opt.no_sync():
                    loss.backward()
                sent_in_no_sync += be.bytes_sent - before
            else:
                loss.backward()
        opt.step()
    return raw(model), sent_in_no_sync


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_no_sync_accumulates_without_communicating(pool, name):
    with_no_sync = pool.run(accumulate, name, 3, True)
    reference = pool.run(accumulate, name, 3, False)
    for (a, sent), (b, _) in zip(with_no_sync, reference):
        assert sent == 0
        assert a == b
    assert len({r[0] for r in with_no_sync}) == 1


def checkpointed(name: str, reentrant: bool, region: str) -> tuple[list[bytes], int]:
    """Six steps (freeze_step 3) with activation checkpointing: of the last Linear (`region`
    "last": its gradients, the backward's first, come in a nested backward under reentrant
    checkpointing), or of every Linear ("all": every gradient does). The parameters after each
    step, and the bytes sent."""
    from torch.utils.checkpoint import checkpoint

    rank = rank_of(4)
    model = deeper_model()
    opt = make_optimizer(name, model, 4, 3, weight_decay=0.01)
    opt.bucket_bytes = 1200
    out = []
    for step in range(6):
        model.zero_grad(set_to_none=True)
        g = torch.Generator().manual_seed(step * 7 + rank)
        x = torch.randn(16, 8, generator=g).requires_grad_()
        h = x
        for i, layer in enumerate(model):
            wrapped = isinstance(layer, torch.nn.Linear) and (region == "all" or i == len(model) - 1)
            h = checkpoint(layer, h, use_reentrant=reentrant) if wrapped else layer(h)
        torch.nn.functional.mse_loss(h, x[:, :4].detach().sin()).backward()
        opt.step()
        out.append(raw(model))
    return out, opt.backend.bytes_sent


@pytest.mark.parametrize("region", ["last", "all"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_reentrant_activation_checkpointing_gives_the_steps_of_non_reentrant(pool, name, region):
    """Under reentrant checkpointing a backward's gradients come partly in backward passes that
    autograd runs nested in it: its end is the outer one's, not a nested one's. Taken for the
    end, a nested one's started the buckets still waiting, from gradients not computed yet,
    which the step then found stale and sent again: the same parameters, about 1.7x the bytes.
    (Within 1%: the small agreements riding on the calls vary a few bytes with their order.)"""
    nested, flat = pool.run(checkpointed, name, True, region), pool.run(checkpointed, name, False, region)
    for (params, sent), (flat_params, flat_sent) in zip(nested, flat):
        assert params == flat_params
        assert abs(sent - flat_sent) <= 0.01 * flat_sent, (sent, flat_sent)


def checkpointed_under_a_scaler(name: str) -> tuple[list[float], list[bool]]:
    """Every Linear under reentrant checkpointing (so every gradient comes in a nested backward
    and no outer end follows the last one) with a GradScaler; rank 1's loss is inf at step 0
    (the first backward, before the buckets are laid out) and at step 4. The scale after each
    step and whether it was skipped."""
    import math

    from reentrant import scaled_step, through_reentrant_checkpoints

    rank = rank_of(4)
    model = deeper_model()
    opt = make_optimizer(name, model, 4, 3)
    opt.bucket_bytes = 1200
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=100)
    scales, skipped = [], []
    for step in range(6):
        model.zero_grad(set_to_none=True)
        g = torch.Generator().manual_seed(step * 7 + rank)
        x = torch.randn(16, 8, generator=g).requires_grad_()
        loss = torch.nn.functional.mse_loss(through_reentrant_checkpoints(model, x), x[:, :4].detach().sin())
        scaler.scale(loss * math.inf if rank == 1 and step in (0, 4) else loss).backward()
        scaled_step(scaler, opt)
        scales.append(scaler.get_scale())
        skipped.append(opt.last_step_skipped)
    return scales, skipped


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_scaler_skips_everywhere_when_every_gradient_comes_in_nested_backwards(pool, name):
    """The end of such a backward is found in step(), after the scaler's check for inf: the
    ranks agreed on non-finite gradients at the nested ends (before, step() refused it as a
    step without a backward)."""
    results = pool.run(checkpointed_under_a_scaler, name)
    for scales, skipped in results:
        assert scales == results[0][0]
        assert skipped == [step in (0, 4) for step in range(6)]

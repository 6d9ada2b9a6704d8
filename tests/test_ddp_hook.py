"""compcomm.ddp on real gloo ranks: DDP with onebit_hook against plain DDP and against
compressed_allreduce itself, bucket rebuilds, sub-groups, checkpoints and collective errors."""

from __future__ import annotations

import gc
import io
import weakref
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

import compcomm
import compcomm.ddp
from compcomm.ddp import OnebitHookState, onebit_hook

from rankpool import caught, group

BUCKET_MB = 0.001  # ~1 KB: the model below gets several DDP buckets after the rebuild


# ------------------------------------------------------------------ helpers run inside ranks


class Net(torch.nn.Module):
    """Parameters registered in the reverse of their use, so DDP's rebuild (by gradient-ready
    order) changes which parameters share a bucket."""

    def __init__(self) -> None:
        super().__init__()
        self.head = torch.nn.Linear(16, 4)
        self.mid = torch.nn.Linear(32, 16)
        self.inp = torch.nn.Linear(8, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(torch.tanh(self.inp(x)))))


def make_net() -> Net:
    torch.manual_seed(0)
    return Net()


def loss_of(model: torch.nn.Module, rank: int, step: int, poison: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, 8, generator=g)
    y = torch.sin(x[:, :4]) + 0.1 * torch.randn(16, 4, generator=g)
    if poison:
        x[0, 0] = float("nan")
    return torch.nn.functional.mse_loss(model(x), y)


def raw(model: torch.nn.Module) -> bytes:
    return b"".join(p.detach().numpy().tobytes() for p in model.parameters())


def grads(model: torch.nn.Module) -> bytes:
    return b"".join(p.grad.numpy().tobytes() for p in model.parameters())


def hooked(
    process_group=None,
    start_iter: int = 2,
    backend=None,
    model: Net | None = None,
    nonfinite: str = "raise",
    grad_scaler: torch.amp.GradScaler | None = None,
) -> tuple[DDP, OnebitHookState]:
    ddp = DDP(model or make_net(), process_group=process_group, bucket_cap_mb=BUCKET_MB)
    state = OnebitHookState(process_group, start_iter, backend, nonfinite, grad_scaler)
    ddp.register_comm_hook(state, onebit_hook)
    return ddp, state


def sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def train(ddp: DDP, opt: torch.optim.Optimizer, steps: range, rank: int) -> list[bytes]:
    out = []
    for step in steps:
        opt.zero_grad(set_to_none=True)
        loss_of(ddp, rank, step).backward()
        opt.step()
        out.append(raw(ddp.module))
    return out


def recording_hook(rec, bucket):  # unannotated: DDP rejects the string annotations of this module
    """onebit_hook, logging (iteration, bucket parameters, input, output) of every call."""
    entry = [rec["state"].iter, tuple(id(p) for p in bucket.parameters()), bucket.buffer().clone(), None]
    rec["log"].append(entry)

    def keep(fut: torch.futures.Future) -> torch.Tensor:
        entry[3] = fut.value().clone()
        return fut.value()

    return onebit_hook(rec["state"], bucket).then(keep)


# ------------------------------------------------------------------ warm-up = plain DDP


def warmup_vs_plain_ddp(members: tuple[int, ...], steps: int) -> list[tuple[bytes, bytes]]:
    rank, pg = dist.get_rank(), group(members)
    plain = DDP(make_net(), process_group=pg, bucket_cap_mb=BUCKET_MB)
    ddp, state = hooked(process_group=pg, start_iter=steps + 1)
    out = []
    for step in range(steps):
        for model in (plain, ddp):
            model.zero_grad(set_to_none=True)
            loss_of(model, rank, step).backward()
        out.append((grads(plain.module), grads(ddp.module)))
    assert state.iter == steps and not any(ef.initialized for ef in state.error_feedback.values())
    return out


@pytest.mark.parametrize("members", [(0, 1, 2, 3), (0, 1, 2)])  # 1/3 is inexact: DDP's x * (1/n) order matters
def test_warmup_iterations_equal_plain_ddp_bitwise(pool, members):
    for rank, pairs in enumerate(pool.run(warmup_vs_plain_ddp, members, 4, ranks=members)):
        for step, (plain, hooked_grads) in enumerate(pairs):
            assert plain == hooked_grads, f"rank {rank}, iteration {step}: hook != DDP"


# ------------------------------------------------------------------ compressed = compressed_allreduce


def compressed_vs_reference(start_iter: int, steps: int, bucket_mb: float = BUCKET_MB) -> dict:
    rank = dist.get_rank()
    ddp = DDP(make_net(), bucket_cap_mb=bucket_mb)
    rec = {"state": OnebitHookState(start_iter=start_iter), "log": []}
    ddp.register_comm_hook(rec, recording_hook)
    params = train(ddp, sgd(ddp), range(steps), rank)
    be = compcomm.backends.get("gloo")
    reference: dict[tuple, compcomm.ErrorFeedback] = {}
    mismatches, layouts = [], {}
    for it, key, before, after in rec["log"]:
        layouts.setdefault(it, []).append(key)
        if it < start_iter:
            continue
        ef = reference.setdefault(key, compcomm.ErrorFeedback())
        expected = compcomm.compressed_allreduce(before.clone(), ef, backend=be)
        if not torch.equal(expected, after):
            mismatches.append((it, len(key)))
    first, later = layouts[0], layouts[steps - 1]
    return {
        "params": params,
        "mismatches": mismatches,
        "first": len(first),
        "later": len(later),
        "regrouped": set(first) != set(later) and len(later) > 1 and layouts[1] == later,
        "state_buckets": len(rec["state"].error_feedback),
    }


@pytest.mark.parametrize("start_iter", [0, 2])
def test_compressed_buckets_equal_compressed_allreduce_per_bucket(pool, start_iter):
    results = pool.run(compressed_vs_reference, start_iter, 6)
    for rank, res in enumerate(results):
        assert res["mismatches"] == [], f"rank {rank}: buckets differ from the reference: {res['mismatches']}"
        assert res["first"] == 1 and res["later"] >= 2 and res["regrouped"], res
        assert res["state_buckets"] == res["later"]  # the pre-rebuild bucket's errors were dropped
    for step in range(6):
        assert len({res["params"][step] for res in results}) == 1, f"ranks differ after step {step}"


def test_a_bucket_the_rebuild_only_reorders_is_reduced_in_its_new_order(pool):
    """DDP's rebuild keeps a one-bucket model's bucket and reorders its parameters: the hook took
    it for the pre-rebuild bucket and reduced a reordered copy of it at every iteration (a
    gather and a scatter of the whole bucket), though that bucket held no errors yet."""
    for rank, res in enumerate(pool.run(compressed_vs_reference, 2, 4, 25.0)):
        assert res["mismatches"] == [], f"rank {rank}: buckets differ from the reference: {res['mismatches']}"
        assert res["first"] == res["later"] == res["state_buckets"] == 1, res


# ------------------------------------------------------------------ sub-group and explicit backends


def on_subgroup(members: tuple[int, ...], explicit_backend: str) -> tuple[list[bytes], int, int]:
    pg = group(members)
    backend = {"none": None, "object": compcomm.backends.get("gloo", group=pg), "name": "gloo"}[explicit_backend]
    ddp, state = hooked(process_group=pg, start_iter=1, backend=backend)
    params = train(ddp, sgd(ddp), range(4), dist.get_rank())
    be = state.backend()
    return params, be.world_size, be.bytes_sent


@pytest.mark.parametrize("explicit_backend", ["none", "object", "name"])
def test_subgroup(pool, explicit_backend):
    """The hook reduces over DDP's process group, also when its backend is given by name (which
    reduced over the default group before)."""
    members = (1, 3)
    results = pool.run(on_subgroup, members, explicit_backend, ranks=members)
    assert len({tuple(r[0]) for r in results}) == 1, "ranks of the sub-group differ"
    assert all(r[1] == 2 and r[2] > 0 for r in results)


# ------------------------------------------------------------------ checkpoints


def roundtrip(obj):
    blob = io.BytesIO()
    torch.save(obj, blob)
    return torch.load(io.BytesIO(blob.getvalue()), weights_only=True)


def resume(k: int, more: int, one_file: bool) -> tuple[list[bytes], list[bytes]]:
    """Train k steps, checkpoint, train `more`; then a fresh DDP model restored from the
    checkpoint replays the same `more` steps."""
    rank = dist.get_rank()
    ddp, state = hooked(start_iter=2)
    opt = sgd(ddp)
    train(ddp, opt, range(k), rank)
    hook_state = state.gathered_state_dict() if one_file else state.state_dict()
    if one_file:  # rank 0 writes the file, every rank reads it
        hook_state = [roundtrip(hook_state) if rank == 0 else None]
        dist.broadcast_object_list(hook_state, src=0)
        hook_state = hook_state[0]
    saved = roundtrip((ddp.module.state_dict(), opt.state_dict(), hook_state))
    straight = train(ddp, opt, range(k, k + more), rank)

    model = make_net()
    model.load_state_dict(saved[0])
    ddp2, state2 = hooked(start_iter=7, model=model)  # start_iter comes back from the checkpoint
    opt2 = sgd(ddp2)
    opt2.load_state_dict(saved[1])
    state2.load_state_dict(saved[2])
    assert state2.iter == k and state2.start_iter == 2
    return straight, train(ddp2, opt2, range(k, k + more), rank)


@pytest.mark.parametrize("one_file", [False, True])
def test_checkpoint_resumes_bitwise(pool, one_file):
    for rank, (straight, resumed) in enumerate(pool.run(resume, 5, 4, one_file)):
        for step, (a, b) in enumerate(zip(straight, resumed)):
            assert a == b, f"rank {rank}: resumed run differs at step {step} after the checkpoint"


def load_other(kind: str):
    rank, n = dist.get_rank(), dist.get_world_size()
    ddp, state = hooked(start_iter=1)
    train(ddp, sgd(ddp), range(3), rank)
    mine = state.state_dict()
    theirs = [None] * n
    dist.all_gather_object(theirs, mine)
    before = state.state_dict()
    if kind == "shifted":
        sd = theirs[(rank + 1) % n]  # every rank loads a neighbour's state
    elif kind == "only_rank_2":
        sd = theirs[0] if rank == 2 else mine  # one rank loads rank 0's (the save-on-rank-0 habit)
    else:
        sd = dict(mine, world_size=n + 1)
    result = caught(state.load_state_dict, sd)
    after = state.state_dict()
    unchanged = after["iter"] == before["iter"] and all(
        torch.equal(a[1]["worker_error"], b[1]["worker_error"]) for a, b in zip(after["buckets"], before["buckets"])
    )
    return result, unchanged


@pytest.mark.parametrize("kind", ["shifted", "only_rank_2", "world_size"])
def test_loading_another_ranks_state_raises_everywhere(pool, kind):
    results = pool.run(load_other, kind)
    assert all(r[0] is not None and r[0][0] == "ValueError" for r in results), results
    assert len({r[0][1] for r in results}) == 1, "ranks raised different errors"
    assert all(r[1] for r in results), "a failed load changed the state"


class Bigger(Net):
    """Net with one more layer at its end: its first parameters (in DDP's order) differ."""

    def __init__(self) -> None:
        super().__init__()
        self.extra = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.extra(super().forward(x))


class Reshaped(torch.nn.Module):
    """As many parameters as Net, of other shapes."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = torch.nn.Linear(8, 20), torch.nn.Linear(20, 20), torch.nn.Linear(20, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


class InOrder(torch.nn.Module):
    """Parameters registered in the order of use, the head's width given: after DDP's rebuild
    the head's bucket (first ready) is reduced first, the input layer's last."""

    def __init__(self, out: int = 4) -> None:
        super().__init__()
        self.inp, self.mid, self.head = torch.nn.Linear(8, 32), torch.nn.Linear(32, 16), torch.nn.Linear(16, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(torch.tanh(self.inp(x)))))[:, :4]


def errors_of(state: OnebitHookState) -> dict:
    return {k: ef.worker_error.clone() for k, ef in state.error_feedback.items() if ef.initialized}


def same_errors(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


MODELS = {"bigger": (Net, Bigger), "reshaped": (Net, Reshaped), "fewer": (Bigger, Net), "head": (InOrder, None)}


def another_model_resumed(kind: str) -> dict:
    """The documented resume order (a fresh hook state, load, register) with another model's
    state. The load cannot tell (the state knows no model yet); the first backward raised inside
    DDP's reducer, which then failed every later backward with an internal assert, or (a model
    with more or fewer parameters, the same first ones) trained on silently with the other
    model's errors. Where a bucket before the last was refused (the head's, of another width),
    the buckets after it kept their new errors."""
    rank = dist.get_rank()
    saved_with, resumed_with = MODELS[kind]
    torch.manual_seed(0)
    ddp, state = hooked(start_iter=1, model=saved_with())
    train(ddp, sgd(ddp), range(3), rank)
    saved = roundtrip(state.state_dict())
    torch.manual_seed(1)
    other = DDP(InOrder(out=5) if kind == "head" else resumed_with(), bucket_cap_mb=BUCKET_MB)
    fresh = OnebitHookState(start_iter=1)
    fresh.load_state_dict(saved)
    other.register_comm_hook(fresh, onebit_hook)
    failures, unchanged = [], []
    for step in range(3):
        before = errors_of(fresh)
        failures.append(caught(lambda: loss_of(other, rank, step).backward()))
        unchanged.append(same_errors(before, errors_of(fresh)))
    return {"failures": failures, "iter": fresh.iter, "unchanged": unchanged}


@pytest.mark.parametrize("kind", list(MODELS))
def test_another_models_state_is_refused_at_every_backward_on_every_rank(pool, kind):
    results = pool.run(another_model_resumed, kind)
    for r in results:
        # a model with fewer parameters is known as such at the first backward's last bucket, after
        # DDP's first buckets replaced the state's (the errors of another model, of no use here)
        assert r["iter"] == 3 and all(r["unchanged"][kind == "fewer" :]), r
        for failure in r["failures"]:
            assert failure is not None and failure[0] == "ValueError" and "another model" in failure[1], r
    assert len({tuple(f[1] for f in r["failures"]) for r in results}) == 1, "ranks raised different errors"


def live_state_loads_a_smaller_models() -> list[tuple[str, str] | None]:
    """A hook state that has numbered a bigger model's parameters loads the state of a model
    whose parameters are the first of them (accepted: they match): the next backward raised an
    IndexError inside DDP's reducer, and DDP failed every backward after with its own error."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    small, small_state = hooked(start_iter=1, model=Net())
    torch.manual_seed(0)
    big, big_state = hooked(start_iter=1, model=Bigger())
    for step in range(2):
        loss_of(small, rank, step).backward()
        loss_of(big, rank, step).backward()
    big_state.load_state_dict(small_state.state_dict())
    return [caught(lambda: loss_of(big, rank, step).backward()) for step in range(2, 5)]


def test_a_live_state_loaded_with_a_smaller_models_state_is_refused_at_every_backward(pool):
    for failures in pool.run(live_state_loads_a_smaller_models):
        for failure in failures:
            assert failure is not None and failure[0] == "ValueError" and "another model" in failure[1], failures


def a_layer_replaced_under_a_live_state() -> tuple[list[tuple[str, str] | None], bytes]:
    """A layer of a trained model replaced (the old one freed), the model wrapped in DDP again
    with the same hook state: the state numbered the new layer's parameters by how many it
    still knew, the numbers of parameters it held already, and the second backward raised a
    KeyError inside DDP's reducer (DDP unusable after)."""
    rank = dist.get_rank()
    ddp, state = hooked(start_iter=1)
    train(ddp, sgd(ddp), range(3), rank)
    model = ddp.module
    del ddp
    torch.manual_seed(1)
    model.head = torch.nn.Linear(16, 4)  # its parameters were the first the state numbered
    gc.collect()
    ddp = DDP(model, bucket_cap_mb=BUCKET_MB)
    ddp.register_comm_hook(state, onebit_hook)
    return [caught(lambda: loss_of(ddp, rank, step).backward()) for step in range(3, 6)], raw(model)


def test_a_layer_replaced_under_a_live_state_gets_numbers_of_its_own(pool):
    results = pool.run(a_layer_replaced_under_a_live_state)
    assert all(failures == [None] * 3 for failures, _ in results), results
    assert len({params for _, params in results}) == 1


def states_of_different_models_loaded() -> tuple[str, str] | None:
    """Per-rank files whose parameters differ (rank 1's from another model, its errors not of
    those parameters' buckets): refused at the load on every rank, before anything is loaded."""
    rank = dist.get_rank()
    ddp, state = hooked(start_iter=1)
    train(ddp, sgd(ddp), range(2), rank)
    saved = state.state_dict()
    if rank == 1:
        saved["params"] = [[[20, 8], "torch.float32"]] + saved["params"][1:]
    return caught(OnebitHookState(start_iter=1).load_state_dict, saved)


def test_per_rank_files_of_different_models_are_refused_at_the_load(pool):
    for failure in pool.run(states_of_different_models_loaded):
        assert failure is not None and failure[0] == "ValueError", failure
        assert "rank 1: ValueError: the state's bucket" in failure[1] and "other parameters" in failure[1], failure


def joined_while_another_rank_fails(start_iter: int) -> dict:
    """Rank 0 runs out of inputs after 3 steps and joins (DDP runs the hook for it with zeros,
    outside any backward); rank 1 meets a NaN at its 5th step. Rank 1's backward raised and kept
    its iter, rank 0's iter moved on, and from then on the ranks disagreed on which iterations
    compress: with start_iter=5 every later collective paired exact with 1-bit, until the
    group's timeout."""
    from torch.distributed.algorithms.join import Join

    rank = dist.get_rank()
    ddp, state = hooked(process_group=group((0, 1)), start_iter=start_iter)
    opt = sgd(ddp)
    failures: list[tuple[str, str] | None] = []
    with Join([ddp]):
        for step in range(3 if rank == 0 else 7):
            opt.zero_grad(set_to_none=True)
            failures.append(caught(lambda: loss_of(ddp, rank, step, poison=rank == 1 and step == 4).backward()))
            if failures[-1] is None:
                opt.step()
    after = caught(lambda: loss_of(ddp, rank, 100).backward())
    return {"failures": [f for f in failures if f is not None], "iter": state.iter, "after": after}


@pytest.mark.parametrize("start_iter", [1, 5])
def test_a_joined_rank_keeps_iter_with_the_ranks_whose_backward_failed(pool, start_iter):
    results = pool.run(joined_while_another_rank_fails, start_iter, ranks=(0, 1))
    assert [len(r["failures"]) for r in results] == [0, 1], results
    assert results[1]["failures"][0][0] == "NonFiniteError", results
    assert results[0]["iter"] == results[1]["iter"] == 7, results  # 7 backwards, one failed, one after join
    assert results[0]["after"] is None and results[1]["after"] is None, results


def broken_channel() -> dict:
    """Collectives refused at submission (a channel an earlier timed-out call broke): the error
    left the hook inside DDP's reducer, which then failed later backwards with its own errors,
    and `iter` moved on where the refused bucket was the iteration's last. Over ranks (0, 2)."""
    from compcomm.backends import ordering

    rank, pg = dist.get_rank(), group((0, 2))
    models = {}
    for start_iter in (1, 10):
        models[f"buckets, start_iter {start_iter}"] = hooked(process_group=pg, start_iter=start_iter)
        one_bucket = DDP(make_net(), process_group=pg, bucket_cap_mb=25)  # the refused bucket is the last
        state = OnebitHookState(pg, start_iter=start_iter)
        one_bucket.register_comm_hook(state, onebit_hook)
        models[f"one bucket, start_iter {start_iter}"] = (one_bucket, state)
    for model, _ in models.values():
        train(model, sgd(model), range(3), rank)
    key = next(iter(models.values()))[1].backend()._channel_key()
    ordering.break_channel(key, "a timed-out call")
    results = {}
    try:
        for name, (model, state) in models.items():
            failures = [caught(lambda: loss_of(model, rank, step).backward()) for step in range(3, 5)]
            results[name] = (failures, state.iter)
    finally:
        del ordering._broken[key]  # the transport itself is fine: the pool's later tests may use the pair
    return results


def test_a_refused_submission_raises_from_backward_and_keeps_iter(pool):
    for r in pool.run(broken_channel, ranks=(0, 2)):
        for name, (failures, iteration) in r.items():
            assert iteration == 3, (name, r)
            for failure in failures:
                assert failure is not None and "unusable after an earlier failure" in failure[1], (name, r)


def warmup_state_loads_anywhere() -> int:
    ddp, state = hooked(start_iter=10)
    train(ddp, sgd(ddp), range(2), dist.get_rank())
    shared = [state.state_dict()]
    dist.broadcast_object_list(shared, src=0)
    fresh = OnebitHookState(start_iter=10)
    fresh.load_state_dict(shared[0])
    return fresh.iter


def never_used_state_loaded_into_a_live_one() -> tuple[tuple[str, str] | None, int]:
    """A state saved before any backward (it knows no parameter) loaded into a hook state that
    has trained: a start over. The numbering the live state kept named parameters the loaded
    state did not have (an IndexError inside DDP's reducer, then a refusal as another model)."""
    rank = dist.get_rank()
    ddp, state = hooked(start_iter=1)
    train(ddp, sgd(ddp), range(2), rank)
    state.load_state_dict(OnebitHookState(start_iter=1).state_dict())
    return caught(lambda: train(ddp, sgd(ddp), range(2, 4), rank)), state.iter


def test_a_never_used_state_loaded_into_a_live_one_starts_over(pool):
    assert pool.run(never_used_state_loaded_into_a_live_one) == [(None, 2)] * 4


def test_state_without_errors_loads_on_any_rank(pool):
    assert pool.run(warmup_state_loads_anywhere) == [2] * 4


def unsupported_gradients(kind: str) -> tuple[list, int]:
    """Two backwards of a float64 model, or of one with a sparse embedding, in the warm-up."""
    torch.manual_seed(0)
    if kind == "float64":
        model, x = make_net().double(), torch.randn(16, 8, dtype=torch.float64)
    else:
        model, x = torch.nn.Sequential(torch.nn.Embedding(10, 8, sparse=True), Net()), torch.arange(16) % 10
    ddp, state = DDP(model, bucket_cap_mb=BUCKET_MB), OnebitHookState(start_iter=2)
    ddp.register_comm_hook(state, onebit_hook)
    return [caught(lambda: ddp(x).sum().backward()) for _ in range(2)], state.iter


@pytest.mark.parametrize(("kind", "says"), [("float64", "bucket of float64 ones"), ("sparse", "sparse ones")])
def test_gradients_the_compression_cannot_take_are_refused_from_the_first_backward(pool, kind, says):
    """A float64 model trained through the whole warm-up, then every rank raised the compressed
    call's TypeError at start_iter; sparse gradients raised "all_reduce needs a contiguous
    tensor" (from a probe). Both are refused at the first backward, on every rank, DDP usable."""
    results = pool.run(unsupported_gradients, kind)
    for failures, iteration in results:
        assert all(f is not None and f[0] == "TypeError" and says in f[1] for f in failures), failures
        assert iteration == 0
    assert len({tuple(r[0]) for r in results}) == 1, "ranks raised different errors"


# ------------------------------------------------------------------ reentrant activation checkpointing


class Checkpointed(Net):
    """Net (its head `width` wide, the first 4 outputs used) with one layer, `segment`, run under
    reentrant activation checkpointing: that layer's gradients come from a backward nested in
    the outer one (a graph task of its own, run inside a node of the outer one)."""

    def __init__(self, segment: str | None, width: int = 4) -> None:
        super().__init__()
        self.segment, self.head = segment, torch.nn.Linear(16, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def layer(name: str, h: torch.Tensor) -> torch.Tensor:
            f = getattr(self, name)
            return checkpoint(f, h, use_reentrant=True) if name == self.segment else f(h)

        return layer("head", torch.tanh(layer("mid", torch.tanh(layer("inp", x)))))[:, :4]


def another_models_state_under_checkpointing(segment: str | None) -> tuple[list, bytes, int]:
    """Another model's state (a head of another width) resumed: three backwards refused, then
    the state mended (a fresh state loaded) and three steps trained, one with a NaN on rank 1;
    `segment` (or no layer) checkpointed. DDP runs with static_graph, its way with reentrant
    checkpoints."""
    rank = dist.get_rank()

    def model(width: int) -> DDP:
        torch.manual_seed(0)
        return DDP(Checkpointed(segment, width), bucket_cap_mb=BUCKET_MB, static_graph=True)

    saved = model(4)
    saved_state = OnebitHookState(start_iter=1)
    saved.register_comm_hook(saved_state, onebit_hook)
    train(saved, sgd(saved), range(3), rank)
    ddp, state = model(5), OnebitHookState(start_iter=1)
    state.load_state_dict(roundtrip(saved_state.state_dict()))
    ddp.register_comm_hook(state, onebit_hook)
    opt, failures = sgd(ddp), []
    for step in range(6):
        if step == 3:
            state.load_state_dict(OnebitHookState(start_iter=1).state_dict())  # mended
        opt.zero_grad(set_to_none=True)
        failures.append(caught(lambda: loss_of(ddp, rank, step, poison=step == 4 and rank == 1).backward()))
        if failures[-1] is None:
            opt.step()
    return failures, raw(ddp.module), state.iter


@pytest.mark.parametrize("segment", ["mid", "head"])
def test_a_refused_backward_under_reentrant_checkpointing_leaves_ddp_usable(pool, segment):
    """The hook took a bucket reduced in the checkpointed layer's nested backward for a new
    backward: it ended the iteration there, raising a refusal recorded before it at that nested
    backward's end, which stopped the outer one before DDP saw its last buckets; every later
    backward then failed inside DDP ("Expected to have finished reduction in the prior
    iteration"; found by a probe). Now the iteration ends with the outer backward: each refusal
    and the NaN raise from backward() on every rank, and the run is bit for bit the one without
    checkpointing."""
    plain = pool.run(another_models_state_under_checkpointing, None)
    for (failures, params, iteration), (_, expected, _) in zip(
        pool.run(another_models_state_under_checkpointing, segment), plain
    ):
        assert all(f is not None and f[0] == "ValueError" and "another model" in f[1] for f in failures[:3]), failures
        assert failures[4] is not None and failures[4][0] == "NonFiniteError", failures
        assert failures[3] is None and failures[5] is None, failures
        assert iteration == 2 and params == expected


# ------------------------------------------------------------------ errors are collective


def nan_on_one_rank(start_iter: int) -> tuple:
    rank = dist.get_rank()
    ddp, state = hooked(start_iter=start_iter)
    opt = sgd(ddp)
    train(ddp, opt, range(3), rank)
    errors_before = [ef.worker_error.clone() for ef in state.error_feedback.values() if ef.initialized]
    opt.zero_grad(set_to_none=True)
    failure = caught(lambda: loss_of(ddp, rank, 3, poison=rank == 1).backward())
    errors_after = [ef.worker_error for ef in state.error_feedback.values() if ef.initialized]
    after = train(ddp, opt, range(4, 6), rank)  # training goes on after the failed iteration
    return failure, len(errors_before), after, all(torch.isfinite(e).all() for e in errors_after)


@pytest.mark.parametrize("start_iter", [1, 10])
def test_nan_gradient_on_one_rank_fails_every_rank_alike(pool, start_iter):
    results = pool.run(nan_on_one_rank, start_iter)
    failures = [r[0] for r in results]
    assert all(f is not None and f[0] == "NonFiniteError" and "NaN" in f[1] for f in failures), failures
    assert all('nonfinite="propagate"' in f[1] for f in failures), "the message names the GradScaler mode"
    assert len({f[1].split("\n")[0] for f in failures}) == 1, "ranks raised different errors"
    assert all(r[3] for r in results), "non-finite values reached the error feedback"
    if start_iter == 1:
        assert results[0][1] >= 2
    assert len({tuple(r[2]) for r in results}) == 1, "ranks differ after recovering"


def nan_in_the_last_bucket_reduced(start_iter: int, only_first_layer: bool) -> tuple:
    """Rank 1's gradients turn NaN at step 3, in every bucket or (`only_first_layer`) only in
    the bucket reduced last, after the others succeeded: backward raises on every rank, and the
    loop catches it and goes on. That backward must leave no trace: every bucket's error state
    and `iter` as before it, so that the run goes on as if it never ran."""
    rank = dist.get_rank()
    ddp, state = hooked(start_iter=start_iter)
    opt = sgd(ddp)
    poisoned = [False]
    for p in ddp.module.inp.parameters():
        p.register_hook(lambda g: g * float("nan") if poisoned[0] else g)
    train(ddp, opt, range(3), rank)
    errors = {key: ef.state_dict() for key, ef in state.error_feedback.items()}
    before = state.iter
    opt.zero_grad(set_to_none=True)
    poisoned[0] = only_first_layer and rank == 1
    failure = caught(lambda: loss_of(ddp, rank, 3, poison=rank == 1 and not only_first_layer).backward())
    poisoned[0] = False
    kept = errors.keys() == state.error_feedback.keys() and all(
        torch.equal(errors[key][k], v) if torch.is_tensor(v) else errors[key][k] == v
        for key, ef in state.error_feedback.items()
        for k, v in ef.state_dict().items()
    )
    unchanged = state.iter == before
    return failure, kept, unchanged, train(ddp, opt, range(4, 6), rank)[-1]


@pytest.mark.parametrize("start_iter", [1, 10])
def test_a_backward_that_raises_leaves_no_trace(pool, start_iter):
    late = pool.run(nan_in_the_last_bucket_reduced, start_iter, True)
    assert all(r[0] is not None and r[0][0] == "NonFiniteError" for r in late), [r[0] for r in late]
    assert all(r[1] for r in late), "the failed backward changed some bucket's error feedback"
    assert all(r[2] for r in late), "the failed backward advanced iter"
    everywhere = pool.run(nan_in_the_last_bucket_reduced, start_iter, False)
    assert len({r[3] for r in late}) == 1 and late[0][3] == everywhere[0][3]


def overflow_under_grad_scaler(start_iter: int, only_first_layer: bool = False) -> tuple:
    """Mixed-precision training's routine overflow: GradScaler's scaled loss gives NaN gradients
    on rank 1 at step 3, in every bucket or (`only_first_layer`) only in the bucket reduced last,
    after the others succeeded; with nonfinite="propagate" every rank must skip that step alike
    and leave no trace of it."""
    rank = dist.get_rank()
    ddp, state = hooked(start_iter=start_iter, nonfinite="propagate")
    opt, scaler = sgd(ddp), torch.amp.GradScaler("cpu", init_scale=2.0**10)
    poisoned = [False]
    for p in ddp.module.inp.parameters():
        p.register_hook(lambda g: g * float("nan") if poisoned[0] else g)

    def step(s: int, poison: bool = False) -> None:
        opt.zero_grad(set_to_none=True)
        poisoned[0] = poison and only_first_layer
        scaler.scale(loss_of(ddp, rank, s, poison and not only_first_layer)).backward()
        scaler.step(opt)
        scaler.update()

    for s in range(3):
        step(s)
    before, scale = raw(ddp.module), scaler.get_scale()
    errors = {
        key: {k: v.clone() if torch.is_tensor(v) else v for k, v in ef.state_dict().items()}
        for key, ef in state.error_feedback.items()
    }
    step(3, poison=rank == 1)
    skipped = raw(ddp.module) == before
    kept = all(
        torch.equal(errors[key][k], v) if torch.is_tensor(v) else errors[key][k] == v
        for key, ef in state.error_feedback.items()
        for k, v in ef.state_dict().items()
    )
    after_skip = scaler.get_scale()
    for s in range(4, 6):
        step(s)
    compressed = any(ef.initialized for ef in state.error_feedback.values())
    return skipped, kept, scale, after_skip, raw(ddp.module), compressed


@pytest.mark.parametrize("start_iter", [1, 10])
@pytest.mark.parametrize("only_first_layer", [False, True])
def test_grad_scaler_overflow_skips_the_step_on_every_rank(pool, start_iter, only_first_layer):
    results = pool.run(overflow_under_grad_scaler, start_iter, only_first_layer)
    assert all(r[0] for r in results), "a rank took the overflowing step"
    assert all(r[1] for r in results), "the overflowing step changed some bucket's error feedback"
    assert all(r[3] == r[2] / 2 for r in results), "the scaler did not back off on every rank"
    assert len({r[4] for r in results}) == 1, "ranks differ after the skipped step"
    assert all(r[5] == (start_iter == 1) for r in results)
    if only_first_layer:  # no trace of the skipped step: the run goes on as if every bucket had failed
        assert results[0][4] == pool.run(overflow_under_grad_scaler, start_iter, False)[0][4]


def side_by_side(
    state: OnebitHookState, scaler: torch.amp.GradScaler, steps: int
) -> tuple[DDP, DDP, torch.optim.Optimizer, torch.optim.Optimizer]:
    """`steps` steps of 1-bit SGD twice, beside each other: plainly, and on `scaler`'s scaled
    loss with the hook state `state`; both models and their optimizers."""
    rank = dist.get_rank()
    plain, _ = hooked(start_iter=1)
    scaled = DDP(make_net(), bucket_cap_mb=BUCKET_MB)
    scaled.register_comm_hook(state, onebit_hook)
    plain_opt, scaled_opt = sgd(plain), sgd(scaled)
    for step in range(steps):
        plain_opt.zero_grad(set_to_none=True)
        loss_of(plain, rank, step).backward()
        plain_opt.step()
        scaled_opt.zero_grad(set_to_none=True)
        scaler.scale(loss_of(scaled, rank, step)).backward()
        scaler.step(scaled_opt)
        scaler.update()
    return plain, scaled, plain_opt, scaled_opt


def scaled_against_unscaled(follow: bool) -> tuple[bytes, bytes, float | None, float | None]:
    """The same 1-bit training twice, side by side: once plainly, once on a GradScaler's scaled
    loss whose scale doubles after every step (growth_interval=1), the hook given the scaler
    (`follow`) or not. Returns both runs' parameters, the scale the errors are kept in, and that
    scale after a state dict round trip."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4, growth_interval=1)
    state = OnebitHookState(start_iter=1, nonfinite="propagate", grad_scaler=scaler if follow else None)
    plain, scaled, _, _ = side_by_side(state, scaler, 6)
    again = OnebitHookState(start_iter=1, nonfinite="propagate", grad_scaler=scaler if follow else None)
    again.load_state_dict(roundtrip(state.state_dict()))
    return raw(plain.module), raw(scaled.module), state._loss_scale.value, again._loss_scale.value


def test_given_the_grad_scaler_errors_follow_its_scale(pool):
    """A power-of-two change of loss scale, with the carried errors rescaled by it, gives bitwise
    the unscaled run (the code is scale-equivariant); before, the errors carried across every
    change counted it once too much, and the runs parted."""
    for plain, scaled, errors_scale, loaded in pool.run(scaled_against_unscaled, True):
        assert scaled == plain
        assert errors_scale == loaded == 2.0**9  # the scale of the last backward (step 5)
    for plain, scaled, errors_scale, _ in pool.run(scaled_against_unscaled, False):
        assert scaled != plain and errors_scale is None


def scaled_then_resumed_unscaled() -> tuple[bytes, bytes]:
    """Three steps under a GradScaler (its scale doubling every step, followed), then resumed
    without one, beside a run that was never scaled."""
    import copy

    rank = dist.get_rank()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=1)
    state = OnebitHookState(start_iter=1, grad_scaler=scaler)
    plain, scaled, plain_opt, scaled_opt = side_by_side(state, scaler, 3)
    resumed = DDP(copy.deepcopy(scaled.module), bucket_cap_mb=BUCKET_MB)
    resumed_state = OnebitHookState(start_iter=1)
    resumed.register_comm_hook(resumed_state, onebit_hook)
    resumed_state.load_state_dict(roundtrip(state.state_dict()))
    resumed_opt = sgd(resumed)
    resumed_opt.load_state_dict(roundtrip(scaled_opt.state_dict()))
    for step in range(3, 5):
        for model, opt in ((plain, plain_opt), (resumed, resumed_opt)):
            opt.zero_grad(set_to_none=True)
            loss_of(model, rank, step).backward()
            opt.step()
    return raw(plain.module), raw(resumed.module)


def test_errors_kept_under_a_scaler_resume_unscaled_without_one(pool):
    """A state without a scaler runs on unscaled gradients: errors saved under scale 2^18 are
    brought back to scale 1 (before, they stayed 2^18 times too large: gaps of 100-800)."""
    for plain, resumed in pool.run(scaled_then_resumed_unscaled):
        assert resumed == plain


def damaged_state_loaded(case: str) -> tuple[tuple[str, str] | None, bool]:
    """A state whose `case` part is damaged, on every rank or on rank 1 alone, loaded into a live
    one: what the load raised, and whether the live state kept everything."""
    rank = dist.get_rank()
    ddp, state = hooked(start_iter=1)
    train(ddp, sgd(ddp), range(3), rank)
    saved = roundtrip(state.state_dict())
    first, errors = saved["buckets"][0]
    if case == "start_iter on rank 1" and rank == 1:
        saved["start_iter"] = 50
    elif case == "iter < 0":
        saved["iter"] = -5
    elif case == "start_iter < 0":
        saved["start_iter"] = -1
    elif case == "bucket renumbered on rank 1" and rank == 1:
        saved["buckets"][0] = (first[::-1], errors)
    elif case == "bucket of another model":
        saved["buckets"][0] = (first[1:], errors)
    elif case == "bucket naming no parameter":
        saved["buckets"][0] = ([*first, 99], errors)
    before = state.state_dict()
    failure = caught(state.load_state_dict, saved)
    after = state.state_dict()
    kept = (after["iter"], after["start_iter"], repr(after["buckets"])) == (
        before["iter"],
        before["start_iter"],
        repr(before["buckets"]),
    )
    return failure, kept


@pytest.mark.parametrize(
    "case,says",
    [
        ("start_iter on rank 1", "different saves"),
        ("iter < 0", "iter and start_iter must be integers >= 0, got (-5, 1)"),
        ("start_iter < 0", "iter and start_iter must be integers >= 0, got (3, -1)"),
        ("bucket renumbered on rank 1", "different saves"),
        ("bucket of another model", "holds errors of other calls than it makes here"),
        ("bucket naming no parameter", "names parameters that are not among its model's"),
    ],
)
def test_a_damaged_state_is_refused_on_every_rank_with_nothing_loaded(pool, case, says):
    """Each loaded before: a start_iter or bucket that differs on one rank made that rank compress
    (or reduce a bucket) the others did not, and the next backward hung; a negative count ran
    uncompressed iterations past start_iter; a bucket of other calls failed every backward after
    the live errors were gone."""
    for failure, kept in pool.run(damaged_state_loaded, case):
        assert failure is not None and failure[0] == "ValueError", failure
        assert says in failure[1], failure
        assert kept


def bad_scale_loaded(case: str) -> tuple[str, str] | None:
    rank = dist.get_rank()
    ddp, state = hooked(start_iter=0)
    for step in range(2):
        loss_of(ddp, rank, step).backward()
    saved = roundtrip(state.state_dict())
    saved["errors_scale"] = {
        "inf": float("inf"),
        "tiny": 1e-40,
        "int": 64,
        "differs": 2.0 ** (10 + rank),
    }[case]
    again = OnebitHookState(start_iter=0)
    return caught(again.load_state_dict, saved)


@pytest.mark.parametrize("case", ["inf", "tiny", "int", "differs"])
def test_a_bad_errors_scale_is_refused_on_every_rank(pool, case):
    """inf passed the check and broke DDP's reducer at the next backward; 1e-40 made the errors
    non-finite (every later step skipped); per-rank scales that differ were taken as they were."""
    for failure in pool.run(bad_scale_loaded, case):
        assert failure is not None and failure[0] == "ValueError", failure
        assert "errors_scale" in failure[1]


def scale_backed_off_to_zero() -> tuple[list[float], int]:
    """A scaler whose scale leaves fp32's normal range (it reaches 0 by backing off): its steps
    are skipped; the hook neither follows that scale nor raises inside DDP's reducer."""
    rank = dist.get_rank()
    ddp, state = hooked(start_iter=0, nonfinite="propagate", grad_scaler=None)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**-125, backoff_factor=2.0**-30)
    state._loss_scale.grad_scaler = scaler
    opt, scales = sgd(ddp), []
    for step in range(3):
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss_of(ddp, rank, step) * (float("inf") if step == 1 else 1.0)).backward()
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales, state.iter


def test_a_scale_out_of_range_is_not_followed(pool):
    for scales, iterations in pool.run(scale_backed_off_to_zero):
        assert scales[0] == 2.0**-125 and scales[1] == 0.0 and iterations == 3


# ------------------------------------------------------------------ the mpi backend (mpirun)


def test_hook_over_mpi_matches_gloo_bitwise(tmp_path):
    from launched import launch, mpirun_python, passed

    cmd = mpirun_python(4) + [str(Path(__file__).parent / "programs" / "ddp_mpi_checks.py"), str(tmp_path)]
    results = passed(launch(cmd, tmp_path, "", 4, 180), "hook")
    assert len({r["mpi"] for r in results}) == 1, "ranks differ over mpi"
    assert all(r["mpi"] == r["gloo"] and r["buckets"] >= 2 and r["mpi_bytes"] > 0 for r in results)


# ------------------------------------------------------------------ argument checks (no ranks)


def backend_over_other_ranks() -> tuple:
    pair = group((1, 3)) if dist.get_rank() in (1, 3) else group((0, 2))
    by_name = OnebitHookState(process_group=pair, backend="gloo")  # built over the pair
    everyone = OnebitHookState(process_group=pair, backend=compcomm.backends.get("gloo"))  # over all four
    return caught(by_name.backend), by_name.backend().world_size, caught(everyone.backend)


def test_a_backend_over_other_ranks_than_ddps_group_is_refused(pool):
    for by_name, size, everyone in pool.run(backend_over_other_ranks):
        assert by_name is None and size == 2
        assert everyone[0] == "ValueError" and "spans 4 ranks, DDP's process group 2" in everyone[1]


def settings_differ(name: str) -> tuple:
    """Rank 3's state differs in one setting; the first backward is where the hook can compare."""
    rank = dist.get_rank()
    setting = {"start_iter": 3 if rank == 3 else 1} if name == "start_iter" else {}
    if name == "nonfinite":
        setting = {"nonfinite": "propagate" if rank == 3 else "raise"}
    if name == "grad_scaler":
        setting = {"grad_scaler": torch.amp.GradScaler("cpu") if rank == 3 else None}
    ddp, state = hooked(**setting)
    failure, iteration = caught(lambda: loss_of(ddp, rank, 0).backward()), state.iter
    state.start_iter, state.nonfinite, state._loss_scale.grad_scaler = 1, "raise", None  # mended: DDP goes on
    for step in range(2):
        loss_of(ddp, rank, step).backward()
    return failure, iteration, state.iter


@pytest.mark.parametrize("name", ["start_iter", "nonfinite", "grad_scaler"])
def test_settings_that_differ_across_ranks_raise_on_every_rank(pool, name):
    """Different start_iter hung every rank (one reduced exactly, another with 1 bit) until the
    group's timeout; now the first backward raises the same ValueError everywhere, iter unmoved,
    from the end of the backward (raised inside DDP's reducer, it would leave DDP unusable)."""
    for failure, iteration, after in pool.run(settings_differ, name):
        assert failure is not None and failure[0] == "ValueError", failure
        assert f"ranks passed different {name}" in failure[1] and iteration == 0, failure
        assert after == 2  # the refusal left DDP's reducer usable


def unbuildable_backend_on_one_rank(bad: str) -> dict:
    """Rank 3's hook state names a backend that does not exist, or nccl on CPU (a RuntimeError,
    missed by a first version of the fix). It raised inside rank 3's hook alone while the other
    ranks waited in the settings' agreement, and so in load_state_dict and gathered_state_dict.
    The backward raises the refusal's own type on every rank, as the other two do (it raised a
    ValueError of differing settings when some ranks refused, the refusal's type when all did)."""
    rank = dist.get_rank()
    ddp, state = hooked(backend=bad if rank == 3 else "gloo")
    before = raw(ddp.module)
    saved = {} if rank == 3 else state.state_dict()  # rank 3 has no backend to describe its place
    backwards = [caught(lambda: loss_of(ddp, rank, step).backward()) for step in range(2)]
    return {
        "backwards": backwards,
        "iter": state.iter,
        "kept": raw(ddp.module) == before,
        "gather": caught(state.gathered_state_dict),
        "load": caught(state.load_state_dict, saved),
    }


@pytest.mark.parametrize(
    "bad, kind, says", [("nope", "ValueError", "unknown backend"), ("nccl", "RuntimeError", "nccl")]
)
def test_unbuildable_backend_on_one_rank_raises_on_every_rank(pool, bad, kind, says):
    for r in pool.run(unbuildable_backend_on_one_rank, bad):
        for failure in r["backwards"]:
            assert failure is not None and failure[0] == kind, r
            assert failure[1].startswith("OnebitHookState's backend: rank 3: ") and says in failure[1], r
        assert r["iter"] == 0 and r["kept"], r
        for failure in (r["gather"], r["load"]):
            assert failure is not None and failure[0] == kind and "rank 3: " in failure[1] and says in failure[1], r


def test_without_a_process_group_the_hook_state_names_init_process_group(monkeypatch):
    """As every compcomm entry point under a launcher: a RuntimeError naming the fix, not
    torch's ValueError (which, from load_state_dict, would read as a refused checkpoint)."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    state = OnebitHookState()
    for method in (state.state_dict, state.backend, state.gathered_state_dict):
        with pytest.raises(RuntimeError, match="init_process_group"):
            method()


def test_a_numpy_start_iter_is_kept_as_an_int():
    """It is saved in the state dict: a numpy scalar there makes torch.load's defaults refuse the file."""
    import numpy as np

    assert type(OnebitHookState(start_iter=np.int64(3)).start_iter) is int


def test_bad_arguments():
    with pytest.raises(ValueError, match="start_iter"):
        OnebitHookState(start_iter=-1)
    with pytest.raises(ValueError, match="nonfinite"):
        OnebitHookState(nonfinite="skip")
    with pytest.raises(ValueError, match="start_iter"):
        OnebitHookState(start_iter=2.5)
    with pytest.raises(TypeError, match="backend"):
        OnebitHookState(backend=3)
    with pytest.raises(TypeError, match="grad_scaler"):
        OnebitHookState(grad_scaler=2.0**16)
    with pytest.raises(ValueError, match="factor > 0"):
        compcomm.ErrorFeedback().rescale_(0.0)
    assert compcomm.ddp.onebit_hook is onebit_hook


def dropped_before_any_step() -> tuple[bool, int, str | None]:
    """A hooked DDP model trained by hand (no torch optimizer steps), then dropped with its state
    inside a cycle of the caller's (as a trainer object holding a bound method of its own keeps
    it), and collected while torch runs the global step pre-hooks of another optimizer's step:
    whether the state was collected, compcomm's global step pre-hooks, and the step's error."""
    from torch.optim.optimizer import _global_optimizer_pre_hooks, register_optimizer_step_pre_hook

    def collect(*args) -> None:  # a library's step pre-hook, registered before the state's look
        gc.collect()

    collecting = register_optimizer_step_pre_hook(collect)
    rank = dist.get_rank(group(4))
    ddp, state = hooked(group(4), start_iter=1)
    for step in range(3):
        loss_of(ddp, rank, step).backward()
    collected = weakref.ref(state)

    class Trainer:
        pass

    trainer = Trainer()
    trainer.ddp, trainer.state, trainer.method = ddp, state, trainer.__init__

    gc.disable()
    try:
        del ddp, state, trainer
        model = torch.nn.Linear(4, 4)
        model(torch.ones(2, 4)).sum().backward()
        failure = caught(torch.optim.SGD(model.parameters(), lr=0.1).step)
    finally:
        gc.enable()
        collecting.remove()
    ours = sum(getattr(hook, "__module__", "") == "compcomm.ddp" for hook in _global_optimizer_pre_hooks.values())
    return collected() is None, ours, failure


def test_a_state_dropped_before_any_optimizer_step_is_collected(pool):
    """The hook's look at the optimizer (a global step pre-hook) held the state: a state whose
    parameters no optimizer stepped, with its error buffers, stayed alive for the life of the
    process. Nor may its going remove a hook while torch iterates over them (the step failed)."""
    assert pool.run(dropped_before_any_step) == [(True, 1, None)] * 4

"""compcomm.fsdp on real FSDP2 models over spawned gloo ranks: FSDP mode on 2, 3 and 4 ranks and
HSDP on 2 replicas x 2 shards, each sharded gradient against a float64 reference built from an
unsharded copy of the model; warm-up, accumulation, non-finite gradients (raise and propagate),
checkpoints and misuse, every error raised on every rank."""

from __future__ import annotations

import dataclasses
import io
import math
import re

import numpy as np
import pytest
import torch

import compcomm

from fsdp_models import NEEDS_FSDP_SEAMS, batch, full_params, loss_of, make_model, shard
from rankpool import caught, group
from reference import assert_close, reference_allreduce, reference_reduce_scatter

pytestmark = NEEDS_FSDP_SEAMS

SHARDS = {"2x2": ((0, 1), (2, 3))}  # HSDP: the shard groups (one per replica)
REPLICAS = {"2x2": ((0, 2), (1, 3))}


# ----------------------------------------------------------------- models on the ranks


def plain_grads(params: list[torch.Tensor], x: torch.Tensor) -> list[np.ndarray]:
    """This rank's local (unreduced) gradients, from an unsharded copy of the model."""
    model = make_model()
    with torch.no_grad():
        for p, value in zip(model.parameters(), params):
            p.copy_(value)
    loss_of(model, x).backward()
    return [p.grad.double().numpy() for p in model.parameters()]


def local_grads(model: torch.nn.Module) -> list[np.ndarray]:
    return [p.grad.to_local().double().numpy() for p in model.parameters()]


def run_fsdp(members: tuple[int, ...], start_iter: int, steps: int, reduce_dtype: str | None = None) -> list[dict]:
    import torch.distributed as dist

    rank = dist.get_rank(group(members))
    model = shard(make_model(), members, None if reduce_dtype is None else getattr(torch, reduce_dtype))
    state = compcomm.fsdp.compress(model, start_iter=start_iter)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    records = []
    for step in range(steps):
        params, x = full_params(model), batch(rank, step)
        loss_of(model, x).backward()
        records.append({"plain": plain_grads(params, x), "sharded": local_grads(model), "iteration": state.iteration})
        opt.step()
        opt.zero_grad()
    return records


# ----------------------------------------------------------------- the reference


MODULES = [[0, 1], [2, 3]]  # parameter indices of each FSDP module (Linear 0, Linear 2)


def module_rows(grads: list[np.ndarray], indices: list[int], n: int) -> np.ndarray:
    """FSDP's reduce-scatter input of one module on one rank: row j = every parameter's dim-0
    chunk j (dim 0 padded to a multiple of n), flattened, one after the other."""
    rows = [[] for _ in range(n)]
    for i in indices:
        g = grads[i].reshape(grads[i].shape[0], -1)
        chunk = math.ceil(g.shape[0] / n)
        padded = np.zeros((chunk * n, g.shape[1]))
        padded[: g.shape[0]] = g
        for j in range(n):
            rows[j].append(padded[j * chunk : (j + 1) * chunk].reshape(-1))
    return np.concatenate([np.concatenate(r) for r in rows])


def sharded_values(grads: list[np.ndarray], indices: list[int]) -> np.ndarray:
    """This rank's shards of one module's gradients, as laid out in its row (padding as zeros)."""
    return np.concatenate([g.reshape(-1) for g in (grads[i] for i in indices)])


def row_of(output: np.ndarray, grads_shapes: list[tuple[int, ...]], indices: list[int], n: int, rank: int):
    """Cut the reference output row of `rank` into its parameters' real (unpadded) shards."""
    parts, offset = [], 0
    for i in indices:
        shape = grads_shapes[i]
        width = int(np.prod(shape[1:])) if len(shape) > 1 else 1
        chunk = math.ceil(shape[0] / n)
        real = max(0, min(shape[0] - rank * chunk, chunk))
        parts.append(output[offset : offset + real * width])
        offset += chunk * width
    return np.concatenate(parts)


@pytest.mark.parametrize("world, reduce_dtype", [(2, None), (3, None), (4, None), (3, "bfloat16"), (3, "float16")])
def test_fsdp_mode_matches_reference(pool, world, reduce_dtype):
    """Two exact iterations, then the 1-bit reduce-scatter with error feedback, each rank's
    gradient shard against the float64 reference of the whole model's layout. With a
    MixedPrecisionPolicy's reduce_dtype, FSDP hands compcomm the gradients in that dtype (fp16:
    divided before and after, as FSDP does against overflow) and compcomm sums them in fp32: the
    reference's inputs are the rounded gradients, its outputs are rounded once."""
    members = tuple(range(world))
    steps, start_iter = 4, 2
    res = pool.run(run_fsdp, members, start_iter, steps, reduce_dtype, ranks=members)
    shapes = [g.shape for g in res[0][0]["plain"]]
    rounded = torch.float32 if reduce_dtype is None else getattr(torch, reduce_dtype)
    rtol = max(1e-5, 2 * torch.finfo(rounded).eps)
    atol = 1e-6 if reduce_dtype is None else rtol  # relative to the row's largest element
    errors = {}
    for step in range(steps):
        assert all(r[step]["iteration"] == step + 1 for r in res)
        for m, indices in enumerate(MODULES):
            inputs = [
                torch.from_numpy(module_rows(res[r][step]["plain"], indices, world)).to(rounded).double().numpy()
                for r in range(world)
            ]
            length = inputs[0].size // world
            if step < start_iter:
                expected = np.stack(inputs).mean(0).reshape(world, length)
            else:
                padded = math.ceil(length / 8) * 8
                worker = errors.get(m, np.zeros((world, world, padded)))
                expected, errors[m] = reference_reduce_scatter(inputs, worker, "mean")
            for r in range(world):
                got = sharded_values(res[r][step]["sharded"], indices)
                want = row_of(expected[r], shapes, indices, world, r)
                assert_close(got, want, rtol=rtol, atol=atol * np.abs(want).max(initial=1.0))


def reduced_twice_per_backward(members: tuple[int, ...], steps: int) -> dict:
    """A model called twice in each forward (two views of the batch): FSDP reduce-scatters each
    module twice per backward. Every call's input and output, and the errors left at the end."""
    import torch.distributed as dist

    rank = dist.get_rank(group(members))
    model = shard(make_model(), members)
    state = compcomm.fsdp.compress(model, start_iter=0)
    calls: list[tuple[str, np.ndarray, np.ndarray]] = []
    reduce = state.reduce_scatter

    def recorded(name, output, tensor, over, op):
        given = tensor.detach().double().numpy().copy()
        reduce(name, output, tensor, over, op)
        calls.append((name, given, output.detach().double().numpy().copy()))

    state.reduce_scatter = recorded
    for step in range(steps):
        x = batch(rank, step)
        (loss_of(model, x) + loss_of(model, -2 * x)).backward()
        model.zero_grad()
    errors = {
        name: None if ef.worker_error is None else ef.worker_error.double().numpy()
        for name, ef in state.error_feedback.items()
    }
    return {"calls": calls, "errors": errors, "iteration": state.iteration}


def test_a_module_reduced_twice_in_one_backward_carries_its_errors_from_call_to_call(pool):
    """Each call of the 1-bit reduce-scatter starts from the errors the one before left, also
    the second call of a backward. Both calls used to read the errors the backward began with
    and write the same spare, which the end of the backward then swapped in and out again: the
    errors of a module reduced twice stayed as they were (None from the start)."""
    members, steps = (0, 1), 3
    res = pool.run(reduced_twice_per_backward, members, steps, ranks=members)
    n = len(members)
    assert all(r["iteration"] == steps for r in res)
    counts = {name: sum(c[0] == name for c in res[0]["calls"]) for name in res[0]["errors"]}
    assert 2 * steps in counts.values(), counts  # FSDP reduces the first layer once: both uses end there
    for name in counts:
        mine = [[c for c in r["calls"] if c[0] == name] for r in res]
        length = mine[0][0][1].size // n
        worker = np.zeros((n, n, math.ceil(length / 8) * 8))
        for k in range(counts[name]):
            expected, worker = reference_reduce_scatter([mine[r][k][1] for r in range(n)], worker, "mean")
            for r in range(n):
                assert_close(mine[r][k][2], expected[r], rtol=1e-5, atol=1e-6 * np.abs(expected[r]).max(initial=1.0))
        for r in range(n):
            got = res[r]["errors"][name]
            assert got is not None, name
            assert_close(got.reshape(n, -1), worker[r], rtol=1e-5, atol=1e-6 * np.abs(worker[r]).max(initial=1.0))


def hsdp_reduced_twice_per_backward(steps: int) -> dict:
    """HSDP on 2 replicas x 2 shards, the model called twice in each forward: the average across
    replicas of each module's shard, replayed afterwards with compressed_allreduce and an
    ErrorFeedback of its own over the same replicas, call by call."""
    import torch.distributed as dist

    rank = dist.get_rank()
    model = shard(make_model(), SHARDS["2x2"][rank // 2])
    state = compcomm.fsdp.compress(model, start_iter=0, replicate_group=group(REPLICAS["2x2"][rank % 2]))
    calls: list[tuple[str, torch.Tensor, torch.Tensor]] = []
    average = state.all_reduce

    def recorded(name, shard_):
        given = shard_.detach().clone()
        average(name, shard_)
        calls.append((name, given, shard_.detach().clone()))

    state.all_reduce = recorded
    for step in range(steps):
        x = batch(rank, step)
        (loss_of(model, x) + loss_of(model, -2 * x)).backward()
        model.zero_grad()
    replayed = {name: compcomm.ErrorFeedback(tag=f"replay:{name}") for name in state.error_feedback}
    same_outputs = True
    for name, given, result in calls:
        again = given.clone()
        compcomm.compressed_allreduce(again, replayed[name], backend=state._modules[name].replicas)
        same_outputs &= torch.equal(again, result)
    same_errors = all(
        torch.equal(replayed[name].worker_error, ef.worker_error)
        and torch.equal(replayed[name].server_error, ef.server_error)
        for name, ef in state.error_feedback.items()
    )
    counts = {name: sum(c[0] == name for c in calls) for name in state.error_feedback}
    return {"counts": counts, "outputs": same_outputs, "errors": same_errors}


def test_hsdp_a_module_averaged_twice_in_one_backward_carries_its_errors_from_call_to_call(pool):
    """HSDP's average across replicas goes through the same per-backward bookkeeping: a module
    averaged twice in one backward gives bitwise what its calls give one after the other."""
    for r in pool.run(hsdp_reduced_twice_per_backward, 3):
        assert 6 in r["counts"].values(), r["counts"]
        assert r["outputs"] and r["errors"], r


class Experts(torch.nn.Module):
    """One FSDP module with two experts of one shape, of which each iteration uses one (as a
    mixture of experts routes): FSDP2 leaves a parameter without a gradient out of the
    module's reduce-scatter unless told otherwise."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Parameter(torch.randn(6, 3))
        self.b = torch.nn.Parameter(torch.randn(6, 3))
        self.use = "a"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ (self.a if self.use == "a" else self.b).t()).pow(2).sum()


def run_experts(steps: int) -> list[dict]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    rank = dist.get_rank()
    model = Experts()
    fully_shard(model, mesh=DeviceMesh.from_group(group((0, 1)), "cpu"))
    compcomm.fsdp.compress(model, start_iter=0)
    records = []
    for step in range(steps):
        model.use = "ab"[step % 2]
        x = torch.randn(5, 3, generator=torch.Generator().manual_seed(100 * step + rank))
        plain = Experts()
        plain.use = model.use
        with torch.no_grad():
            for p, value in zip(plain.parameters(), full_params(model)):
                p.copy_(value)
        plain(x).backward()
        model(x).backward()
        records.append(
            {
                "plain": [np.zeros(p.shape) if p.grad is None else p.grad.double().numpy() for p in plain.parameters()],
                "sharded": [None if p.grad is None else p.grad.to_local().double().numpy() for p in model.parameters()],
            }
        )
        for p in model.parameters():
            p.grad = None
    return records


def test_a_parameter_without_a_gradient_keeps_its_own_error_feedback(pool):
    """Each expert's error feedback stays its own when the other is used: the module's
    reduce-scatter always holds both (the unused one with a zero gradient plus its error), as in
    the float64 reference. FSDP2 left the unused one out, so that one expert's errors were added
    to the other's gradient (the rows are laid out by position), silently."""
    res = pool.run(run_experts, 4, ranks=(0, 1))
    shapes = [g.shape for g in res[0][0]["plain"]]
    worker = None
    for step in range(4):
        inputs = [module_rows(res[r][step]["plain"], [0, 1], 2) for r in range(2)]
        length = inputs[0].size // 2
        if worker is None:
            worker = np.zeros((2, 2, math.ceil(length / 8) * 8))
        expected, worker = reference_reduce_scatter(inputs, worker, "mean")
        for r in range(2):
            assert all(g is not None for g in res[r][step]["sharded"]), (step, r)
            got = sharded_values(res[r][step]["sharded"], [0, 1])
            want = row_of(expected[r], shapes, [0, 1], 2, r)
            assert_close(got, want, rtol=1e-5, atol=1e-6 * np.abs(want).max(initial=1.0))


def unfrozen_midway() -> dict:
    """The first Linear's weight stops requiring gradients after two backwards (as progressive
    freezing would): FSDP then leaves it out of the module's reduce-scatter, so the module's
    errors no longer fit the layout. Refused on every rank, every time, until its error feedback
    is reset; then training goes on. A same-shaped swap would have passed silently."""
    import torch.distributed as dist

    rank = dist.get_rank()
    model = shard(make_model(), (0, 1, 2, 3))
    state = compcomm.fsdp.compress(model, start_iter=1)
    for step in range(2):
        loss_of(model, batch(rank, step)).backward()
        model.zero_grad()
    model[0].weight.requires_grad_(False)
    refusals = []
    for step in range(2, 4):
        refusals.append(caught(lambda: loss_of(model, batch(rank, step)).backward()))
        model.reset_iter_state()
        model.zero_grad()
    state.error_feedback["0"].reset()
    loss_of(model, batch(rank, 4)).backward()
    return {"refusals": refusals, "iteration": state.iteration, "weight_grad": model[0].weight.grad is None}


def test_a_parameter_that_stops_requiring_gradients_is_refused_until_reset(pool):
    for r in pool.run(unfrozen_midway):
        for refusal in r["refusals"]:
            assert refusal is not None and refusal[0] == "ValueError", r
            assert "rank 0: the parameters of FSDP module '0' that require gradients changed" in refusal[1], r
        assert r["iteration"] == 3 and r["weight_grad"], r


def resumed_with_another_frozen(start_iter: object) -> dict:
    """Errors saved while expert b was frozen, loaded into a model where a is (the same shape,
    so the same layout size): the first backward is refused on every rank, as a change of
    requires_grad in one run is. The checkpoint did not say which parameters its errors were
    of, and they met the other expert's gradients. `start_iter` a numpy integer: the state's
    file loads with torch.load's defaults (it held a numpy scalar, which they refuse)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    rank = dist.get_rank()

    def built(frozen: str) -> tuple[Experts, compcomm.fsdp.CompressionState]:
        model = Experts()
        getattr(model, frozen).requires_grad_(False)
        model.use = "b" if frozen == "a" else "a"
        fully_shard(model, mesh=DeviceMesh.from_group(group((0, 1)), "cpu"))
        return model, compcomm.fsdp.compress(model, start_iter=start_iter)

    model, state = built("b")
    for step in range(2):
        model(torch.randn(5, 3, generator=torch.Generator().manual_seed(10 * step + rank))).backward()
    buffer = io.BytesIO()
    torch.save(state.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer)
    other, resumed = built("a")
    resumed.load_state_dict(saved)
    refusal = caught(lambda: other(torch.randn(5, 3)).backward())
    return {"refusal": refusal}


@pytest.mark.parametrize("start_iter", [0, np.int64(0)])
def test_errors_resumed_under_another_requires_grad_layout_are_refused(pool, start_iter):
    for r in pool.run(resumed_with_another_frozen, start_iter, ranks=(0, 1)):
        refusal = r["refusal"]
        assert refusal is not None and refusal[0] == "ValueError", r
        assert "rank 0: the parameters of FSDP module '' that require gradients changed" in refusal[1], r


class Detour(torch.nn.Module):
    """A model whose middle FSDP module only the first step's forward runs (see `resume`)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first, self.middle, self.last = torch.nn.Linear(5, 7), torch.nn.Linear(7, 7), torch.nn.Linear(7, 3)

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        h = torch.tanh(self.first(x))
        return self.last(torch.tanh(self.middle(h)) if step == 0 else h).pow(2).sum()


def test_a_resumed_run_reduces_a_module_its_forward_has_not_run_yet(pool):
    """Six 1-bit steps of `Detour` straight, and three + save + load + three: the same bits. FSDP
    reduced the middle module (zeros and its errors) in the steps that did not run it only in the
    process whose forward had once run it, so the resumed run left it out, and drifted."""
    for straight, resumed in pool.run(resume, False, True):
        assert straight == resumed


def grouped_and_frozen() -> dict:
    """The modules of one `fully_shard([first, middle])` are one entry, "first+middle", whose
    layout covers both: freezing first's bias is refused with the layout's message until the
    entry is reset. Their errors lived under "middle" alone, "first" held an ErrorFeedback never
    used, and the layout check saw only middle's parameters (the size message; resetting
    "first", as the docs led to, never recovered)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    rank = dist.get_rank()
    model = Detour()
    mesh = DeviceMesh.from_group(group((0, 1)), "cpu")
    fully_shard([model.first, model.middle], mesh=mesh)
    fully_shard(model, mesh=mesh)
    state = compcomm.fsdp.compress(model, start_iter=1)
    for step in range(3):
        model(batch(rank, step), step).backward()
        model.zero_grad()
    model.first.bias.requires_grad_(False)
    refusal = caught(lambda: model(batch(rank, 3), 3).backward())
    model.reset_iter_state()
    model.zero_grad()
    state.error_feedback["first+middle"].reset()
    after = caught(lambda: model(batch(rank, 4), 4).backward())
    return {"names": sorted(state.error_feedback), "refusal": refusal, "after": after, "iteration": state.iteration}


def test_modules_sharded_together_are_compressed_as_one(pool):
    for r in pool.run(grouped_and_frozen, ranks=(0, 1)):
        assert r["names"] == ["", "first+middle"], r
        refusal = r["refusal"]
        assert refusal is not None and "FSDP module 'first+middle' that require gradients changed" in refusal[1], r
        assert r["after"] is None and r["iteration"] == 4, r


def run_hsdp(steps: int, start_iter: int, seed_per_rank: bool, intra: str | None = None) -> list[dict]:
    import torch.distributed as dist

    rank = dist.get_rank()
    shard_members, replica_members = SHARDS["2x2"][rank // 2], REPLICAS["2x2"][rank % 2]
    model = shard(make_model(seed=rank if seed_per_rank else 0), shard_members)
    state = compcomm.fsdp.compress(model, start_iter=start_iter, replicate_group=group(replica_members), intra=intra)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    records = [{"after": [p.to_local().detach().clone().numpy().tobytes() for p in model.parameters()]}]
    for step in range(steps):
        params, x = full_params(model), batch(rank, step)
        loss_of(model, x).backward()
        plain = plain_grads(params, x)
        sharded = local_grads(model)
        opt.step()
        opt.zero_grad()
        records.append(
            {
                "plain": plain,
                "sharded": sharded,
                "after": [p.to_local().detach().clone().numpy().tobytes() for p in model.parameters()],
                "errors": {
                    k: v.worker_error.double().numpy() for k, v in state.error_feedback.items() if v.initialized
                },
            }
        )
    return records


@pytest.mark.parametrize("intra", [None, "shm"])
def test_hsdp_replicas_start_equal_stay_bitwise_equal_and_match_reference(pool, intra):
    """2 replicas x 2 shards, ranks seeded differently: compress makes the replicas equal;
    each shard's gradient is the exact mean inside the replica (FSDP's process group, or
    compcomm's shm backend with intra="shm"), then the 1-bit mean across replicas
    (reference_allreduce on the shard means), and replicas stay bitwise equal."""
    steps, start_iter = 4, 1
    res = pool.run(run_hsdp, steps, start_iter, True, intra)
    for step in range(steps + 1):
        assert res[0][step]["after"] == res[2][step]["after"] and res[1][step]["after"] == res[3][step]["after"]
    shapes = [g.shape for g in res[0][1]["plain"]]
    errors: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
    for step in range(1, steps + 1):
        for m, indices in enumerate(MODULES):
            for s in range(2):  # shard index: ranks s and s + 2 hold it
                shard_means = []
                for replica in range(2):
                    members = SHARDS["2x2"][replica]
                    rows = np.stack([module_rows(res[r][step]["plain"], indices, 2) for r in members]).mean(0)
                    shard_means.append(rows.reshape(2, -1)[s])
                if step <= start_iter:
                    expected = np.mean(shard_means, axis=0)
                else:
                    numel = shard_means[0].size
                    m_pad = math.ceil(numel / 16) * 16
                    worker, server = errors.get((m, s), (np.zeros((2, m_pad)), np.zeros((2, m_pad // 2))))
                    expected, worker, server = reference_allreduce(shard_means, worker, server, "mean")
                    errors[(m, s)] = (worker, server)
                for r in (s, s + 2):
                    got = sharded_values(res[r][step]["sharded"], indices)
                    want = row_of(expected, shapes, indices, 2, s)
                    assert_close(got, want, rtol=1e-5, atol=1e-6 * np.abs(want).max(initial=1.0))


def test_hsdp_intra_shm_trains_bit_for_bit_as_fsdp_own_group(pool):
    """intra="shm" only moves FSDP's bytes another way (two ranks per replica: the sum of two
    terms has one order), so the parameters after every step are those of FSDP's own group."""
    own, shm = pool.run(run_hsdp, 3, 1, True), pool.run(run_hsdp, 3, 1, True, "shm")
    for r in range(4):
        assert [step["after"] for step in own[r]] == [step["after"] for step in shm[r]]


# ----------------------------------------------------------------- activation checkpointing


@dataclasses.dataclass
class Boxed:
    """A model output that is not a tensor (FSDP finds the tensors in dataclasses too)."""

    y: torch.Tensor


class Checkpointed(torch.nn.Module):
    """make_model's layers, each run under activation checkpointing in the model's forward,
    the output `boxed` in a dataclass or not."""

    def __init__(self, reentrant: bool, boxed: bool) -> None:
        super().__init__()
        self.layers, self.reentrant, self.boxed = make_model(), reentrant, boxed

    def forward(self, x: torch.Tensor) -> torch.Tensor | Boxed:
        from torch.utils.checkpoint import checkpoint

        for layer in self.layers:
            x = checkpoint(layer, x, use_reentrant=self.reentrant)
        return Boxed(x) if self.boxed else x


def checkpointed(reentrant: bool, hsdp: bool, boxed: bool) -> dict:
    """Four steps of OnebitAdam (freeze_step = start_iter = 2) on a model whose layers are
    checkpointed: reentrant checkpointing differentiates each layer in a backward nested in the
    model's. Each step's gradients and parameters, and the iteration after each backward."""
    import torch.distributed as dist

    rank = dist.get_rank()
    model = Checkpointed(reentrant, boxed)
    members = SHARDS["2x2"][rank // 2] if hsdp else (0, 1, 2, 3)
    shard(model.layers, members)
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    fully_shard(model, mesh=DeviceMesh.from_group(group(members), "cpu"))
    replicas = group(REPLICAS["2x2"][rank % 2]) if hsdp else None
    state = compcomm.fsdp.compress(model, start_iter=2, replicate_group=replicas)
    opt = compcomm.optim.OnebitAdam(model.parameters(), lr=0.01, freeze_step=2)
    records = []
    for step in range(4):
        out = model(batch(rank, step).requires_grad_())
        (out.y if boxed else out).pow(2).sum().backward()
        grads = [p.grad.to_local().clone() for p in model.parameters()]
        opt.step()
        opt.zero_grad()
        records.append({"iteration": state.iteration, "grads": grads, "params": full_params(model)})
    return {"records": records, "errors": {k: v.worker_error.clone() for k, v in state.error_feedback.items()}}


@pytest.mark.parametrize("hsdp, boxed", [(False, False), (True, False), (False, True)])
def test_reentrant_activation_checkpointing_counts_one_iteration_per_backward(pool, hsdp, boxed):
    """Reentrant checkpointing runs the reductions of each layer in a nested backward: they
    belong to the model's backward (one iteration each, the 1-bit stage and OnebitAdam's frozen
    variance at step 3), bit for bit as with non-reentrant checkpointing; also when the model's
    output is a dataclass."""
    nested, flat = pool.run(checkpointed, True, hsdp, boxed), pool.run(checkpointed, False, hsdp, boxed)
    for a, b in zip(nested, flat):
        assert [r["iteration"] for r in a["records"]] == [1, 2, 3, 4]
        for ra, rb in zip(a["records"], b["records"]):
            assert all(torch.equal(x, y) for x, y in zip(ra["grads"], rb["grads"]))
            assert all(torch.equal(x, y) for x, y in zip(ra["params"], rb["params"]))
        assert a["errors"].keys() == b["errors"].keys()
        assert all(torch.equal(a["errors"][k], b["errors"][k]) for k in a["errors"])


def probed_first(probe: bool, hsdp: bool) -> dict:
    """Four steps of OnebitAdam (freeze_step = start_iter = 2), each backward preceded (`probe`)
    by `torch.autograd.grad` of the loss with respect to the input (a saliency map, an
    adversarial example): a pass that takes no gradient into the parameters. Each step's
    gradients and parameters, the iteration after each backward, the bytes sent, the errors."""
    import torch.distributed as dist

    rank = dist.get_rank()
    members = SHARDS["2x2"][rank // 2] if hsdp else (0, 1, 2, 3)
    model = shard(make_model(), members)
    replicas = group(REPLICAS["2x2"][rank % 2]) if hsdp else None
    state = compcomm.fsdp.compress(model, start_iter=2, replicate_group=replicas)
    opt = compcomm.optim.OnebitAdam(model.parameters(), lr=0.01, freeze_step=2)
    records = []
    for step in range(4):
        if probe:
            x = batch(rank, 10 + step).requires_grad_()
            (saliency,) = torch.autograd.grad(loss_of(model, x), x)
            assert saliency.abs().sum() > 0
        loss_of(model, batch(rank, step)).backward()
        grads = [p.grad.to_local().clone() for p in model.parameters()]
        opt.step()
        opt.zero_grad()
        records.append({"iteration": state.iteration, "grads": grads, "params": full_params(model)})
    errors = {k: v.worker_error.clone() for k, v in state.error_feedback.items()}
    return {"records": records, "errors": errors, "sent": state.bytes_sent}


@pytest.mark.parametrize("hsdp", [False, True])
def test_a_pass_that_takes_no_parameter_gradient_reduces_nothing(pool, hsdp):
    """torch.autograd.grad through the model before each backward: no iteration counted, no
    error state touched, no gradient bytes sent (as FSDP sends none there), bit for bit the
    run without it."""
    probed, plain = pool.run(probed_first, True, hsdp), pool.run(probed_first, False, hsdp)
    for a, b in zip(probed, plain):
        assert [r["iteration"] for r in a["records"]] == [1, 2, 3, 4]
        for ra, rb in zip(a["records"], b["records"]):
            assert all(torch.equal(x, y) for x, y in zip(ra["grads"], rb["grads"]))
            assert all(torch.equal(x, y) for x, y in zip(ra["params"], rb["params"]))
        assert all(torch.equal(a["errors"][k], b["errors"][k]) for k in b["errors"])
        assert a["sent"] - b["sent"] < 1024, (a["sent"], b["sent"])  # the passes' small verdicts alone


def probed_after_accumulating(probe: bool, reduce_dtype: torch.dtype | None) -> dict:
    """A micro-batch without sync, then with sync either `torch.autograd.grad` with respect to
    the input (`probe`) or the backward of a zero loss: FSDP reduces the kept gradients in
    either pass (kept aside in the reduce dtype where it differs), and so does the compression."""
    import torch.distributed as dist

    rank = dist.get_rank()
    model = shard(make_model(), (0, 1, 2, 3), reduce_dtype)
    state = compcomm.fsdp.compress(model, start_iter=0)
    model.set_requires_gradient_sync(False)
    loss_of(model, batch(rank, 0)).backward()
    model.set_requires_gradient_sync(True)
    x = batch(rank, 1).requires_grad_()
    if probe:
        torch.autograd.grad(loss_of(model, x), x)
    else:
        (0 * loss_of(model, x)).backward()
    return {"iteration": state.iteration, "grads": [p.grad.to_local().clone() for p in model.parameters()]}


@pytest.mark.parametrize("reduce_dtype", [None, torch.bfloat16])
def test_a_pass_that_takes_no_parameter_gradient_reduces_gradients_kept_without_sync(pool, reduce_dtype):
    probed, plain = (
        pool.run(probed_after_accumulating, True, reduce_dtype),
        pool.run(probed_after_accumulating, False, reduce_dtype),
    )
    for a, b in zip(probed, plain):
        assert a["iteration"] == b["iteration"] == 1
        assert all(torch.equal(x, y) for x, y in zip(a["grads"], b["grads"]))


class Skippable(torch.nn.Module):
    """A block that a forward may pass by (an early exit, stochastic depth): its parameters then
    take no gradient in that backward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.skip = torch.nn.Linear(7, 7), False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.skip else torch.tanh(self.lin(x))


def last_block_errors(state: compcomm.fsdp.CompressionState | None) -> torch.Tensor | None:
    errors = None if state is None else state.error_feedback["2"].worker_error
    return None if errors is None else errors.clone()


def skipping(compressed: bool, start_iter: int, skips: str) -> dict:
    """Three training backwards of a model whose last block, the module reduced first, is passed
    by on rank 0 alone (`skips="rank0"`) or on every rank at the second step (`"all"`)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), Skippable(), Skippable())
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = DeviceMesh.from_group(group((0, 1, 2, 3)), "cpu")
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    state = compcomm.fsdp.compress(model, start_iter=start_iter) if compressed else None
    if state is None:
        model.set_reduce_scatter_unused_params(True)  # as compress has FSDP do
    records = []
    for step in range(3):
        model[2].skip = rank == 0 if skips == "rank0" else step == 1
        errors = last_block_errors(state)
        loss_of(model, batch(rank, step)).backward()
        grads = [p.grad.to_local().clone() for p in model.parameters()]
        after = last_block_errors(state)
        records.append({"grads": grads, "errors": (errors, after)})
        model.zero_grad()
    return {"records": records, "iteration": None if state is None else state.iteration}


def test_a_block_passed_by_on_one_rank_reduces_as_fsdp_does(pool):
    """The module reduced first takes no gradient on rank 0 alone: every rank still reduces it
    (rank 0's zeros) as FSDP does (the exact path, to fp32 rounding: its sums run in rank
    order), and each backward counts."""
    compressed, plain = pool.run(skipping, True, 1000, "rank0"), pool.run(skipping, False, 1000, "rank0")
    for a, b in zip(compressed, plain):
        assert a["iteration"] == 3
        for ra, rb in zip(a["records"], b["records"]):
            for x, y in zip(ra["grads"], rb["grads"]):
                assert_close(x.double().numpy(), y.double().numpy(), rtol=1e-5, atol=1e-6)


def test_a_block_passed_by_everywhere_still_sends_its_carried_error(pool):
    """In 1 bit, a module without gradients in a training backward reduces its zeros: its
    carried error goes out (a gradient of it, an error that shrinks), wherever it falls in the
    order of reductions."""
    for res in pool.run(skipping, True, 0, "all"):
        before, after = res["records"][1]["errors"]
        assert res["iteration"] == 3
        assert after.abs().max() < before.abs().max()
        assert any(g.abs().max() > 0 for g in res["records"][1]["grads"][-2:])


class Box:
    """A saved activation, held where a weak reference can watch it."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def forwards_dropped(compressed: bool) -> list[bool]:
    """Which of the activations a forward saved are freed as soon as its output is dropped (no
    backward ran; the cycle collector kept off)."""
    import gc
    import weakref

    import torch.distributed as dist

    model = shard(make_model(), (0, 1, 2, 3))
    if compressed:
        compcomm.fsdp.compress(model)
    boxes: list[weakref.ref] = []

    def pack(tensor: torch.Tensor) -> Box:
        box = Box(tensor)
        boxes.append(weakref.ref(box))
        return box

    gc.disable()
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda box: box.tensor):
            out = loss_of(model, batch(dist.get_rank(), 0))
        del out
        return [box() is None for box in boxes]
    finally:
        gc.enable()


def test_a_dropped_forward_frees_its_graph_at_once(pool):
    """As much as without compcomm: its hooks on the outputs tie no graph to itself."""
    for compressed, plain in zip(pool.run(forwards_dropped, True), pool.run(forwards_dropped, False)):
        assert compressed == plain and sum(compressed) >= 3, (compressed, plain)


def probed_on_one_rank_without_sync(probe: bool) -> dict:
    """Micro-batches without sync (nor resharding after backward, as FSDP advises), in the second
    of which rank 0 alone first takes `torch.autograd.grad` (a logged saliency), then the
    syncing micro-batch: FSDP communicates nothing in rank 0's extra pass, nor does compcomm."""
    import torch.distributed as dist

    rank = dist.get_rank()
    model = shard(make_model(), (0, 1, 2, 3))
    state = compcomm.fsdp.compress(model, start_iter=0)
    model.set_requires_gradient_sync(False)
    model.set_reshard_after_backward(False)
    for micro in range(2):
        x = batch(rank, micro).requires_grad_()
        loss = loss_of(model, x)
        if probe and rank == 0 and micro == 1:
            torch.autograd.grad(loss, x, retain_graph=True)
        loss.backward()
    model.set_requires_gradient_sync(True)
    model.set_reshard_after_backward(True)
    loss_of(model, batch(rank, 2)).backward()
    return {"iteration": state.iteration, "grads": [p.grad.to_local().clone() for p in model.parameters()]}


def test_a_gradient_free_pass_on_one_rank_without_sync_waits_on_no_one(pool):
    for a, b in zip(pool.run(probed_on_one_rank_without_sync, True), pool.run(probed_on_one_rank_without_sync, False)):
        assert a["iteration"] == b["iteration"] == 1
        assert all(torch.equal(x, y) for x, y in zip(a["grads"], b["grads"]))


class Shortcut(torch.nn.Module):
    """make_model's layers, passed by (the input doubled) for an `easy` batch."""

    def __init__(self) -> None:
        super().__init__()
        self.layers, self.easy = make_model(), False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, :3] * 2 if self.easy else self.layers(x)


def saliency_with_a_shortcut() -> list[int]:
    """`torch.autograd.grad` with respect to the input on every rank, where rank 0's output
    took no parameter at the second step: every rank sees a gradient-free pass (the input's
    leaf says so where no parameter can); the iterations after each step."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    rank = dist.get_rank()
    model = Shortcut()  # one FSDP module: its forward gathers its parameters on every rank alike
    fully_shard(model, mesh=DeviceMesh.from_group(group((0, 1, 2, 3)), "cpu"))
    state = compcomm.fsdp.compress(model, start_iter=0)
    iterations = []
    for step in range(3):
        model.easy = rank == 0 and step == 1
        x = batch(rank, step).requires_grad_()
        torch.autograd.grad(loss_of(model, x), x)
        model.easy = False
        loss_of(model, batch(rank, 10 + step)).backward()
        model.zero_grad()
        iterations.append(state.iteration)
    return iterations


def test_a_gradient_free_pass_through_a_parameter_free_shortcut_on_one_rank(pool):
    assert pool.run(saliency_with_a_shortcut) == [[1, 2, 3]] * 4


def raised_midway() -> dict:
    """A backward that raises after a reduction, outside compcomm (a gradient hook of the
    user's, on every rank), then FSDP's recovery: the next backward is the model's second
    iteration, with the errors of the first alone (those of the raising one dropped)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    runs = {}
    for raising in (False, True):
        model = shard(make_model(), (0, 1, 2, 3))
        state = compcomm.fsdp.compress(model, start_iter=0)
        loss_of(model, batch(rank, 0)).backward()
        model.zero_grad()
        failure = None
        if raising:

            def refuse(grad: torch.Tensor) -> None:
                raise RuntimeError("the user's hook")

            def arm(module: torch.nn.Module, args: tuple, out: torch.Tensor) -> None:
                out.register_hook(refuse)

            armed = model[0].register_forward_hook(arm)
            failure = caught(lambda: loss_of(model, batch(rank, 5)).backward())
            armed.remove()
            model.reset_iter_state()
            model.zero_grad()
        loss_of(model, batch(rank, 1)).backward()
        runs[raising] = {
            "failure": failure,
            "iteration": state.iteration,
            "grads": [p.grad.to_local().clone() for p in model.parameters()],
        }
    return runs


def test_a_backward_that_raised_outside_compcomm_is_not_counted(pool):
    for r in pool.run(raised_midway):
        assert r[True]["failure"] is not None and "the user's hook" in r[True]["failure"][1], r
        assert r[True]["iteration"] == r[False]["iteration"] == 2
        assert all(torch.equal(x, y) for x, y in zip(r[True]["grads"], r[False]["grads"]))


# ----------------------------------------------------------------- accumulation, non-finite gradients


def accumulate(start_iter: int) -> dict:
    """Two micro-batches, the first without sync: one reduction of the summed gradients."""
    import torch.distributed as dist

    rank = dist.get_rank()
    model = shard(make_model(), (0, 1, 2, 3))
    state = compcomm.fsdp.compress(model, start_iter=start_iter)
    params = full_params(model)
    model.set_requires_gradient_sync(False)
    loss_of(model, batch(rank, 0)).backward()
    model.set_requires_gradient_sync(True)
    loss_of(model, batch(rank, 1)).backward()
    plain = [a + b for a, b in zip(plain_grads(params, batch(rank, 0)), plain_grads(params, batch(rank, 1)))]
    return {"plain": plain, "sharded": local_grads(model), "iteration": state.iteration}


def test_accumulation_without_sync_reduces_once(pool):
    res = pool.run(accumulate, 0)
    assert all(r["iteration"] == 1 for r in res)
    shapes = [g.shape for g in res[0]["plain"]]
    for indices in MODULES:
        inputs = [module_rows(res[r]["plain"], indices, 4) for r in range(4)]
        padded = math.ceil(inputs[0].size // 4 / 8) * 8
        expected, _ = reference_reduce_scatter(inputs, np.zeros((4, 4, padded)), "mean")
        for r in range(4):
            got = sharded_values(res[r]["sharded"], indices)
            assert_close(got, row_of(expected[r], shapes, indices, 4, r), rtol=1e-5, atol=1e-6)


class NaNGradient(torch.autograd.Function):
    """The identity forward; NaN for the gradient backward."""

    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        return x.clone()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return grad * float("nan")


def poisoned(nonfinite: str, hsdp: bool, where: str = "input") -> dict:
    """Two good iterations, then NaN at the third on rank 1, then a good one. The NaN is in the
    input (every module's gradient: the first one reduced fails), or only in the gradient that
    reaches the first Linear, the module reduced last (`where="first"`): the other module's
    reduction has then passed in the same backward."""
    import torch.distributed as dist

    rank = dist.get_rank()
    if hsdp:
        model = shard(make_model(), SHARDS["2x2"][rank // 2])
        replicas = group(REPLICAS["2x2"][rank % 2])
    else:
        model, replicas = shard(make_model(), (0, 1, 2, 3)), None
    state = compcomm.fsdp.compress(model, start_iter=1, replicate_group=replicas, nonfinite=nonfinite)
    for step in range(2):
        loss_of(model, batch(rank, step)).backward()
        model.zero_grad()
    before = {k: v.state_dict()["worker_error"].clone() for k, v in state.error_feedback.items()}
    x = batch(rank, 2)
    poison = None
    if rank == 1 and where == "input":
        x[0, 0] = float("nan")
    elif rank == 1:
        poison = model[0].register_forward_hook(lambda _, __, out: NaNGradient.apply(out))
    failure = caught(lambda: loss_of(model, x).backward())
    if poison is not None:
        poison.remove()
    if failure is not None:
        model.reset_iter_state()
    grads_nan = [bool(torch.isnan(p.grad.to_local()).all()) for p in model.parameters() if p.grad is not None]
    after = {k: v.state_dict()["worker_error"] for k, v in state.error_feedback.items()}
    unchanged = {k: bool(torch.equal(before[k], after[k])) for k in before}
    iteration = state.iteration
    model.zero_grad()
    loss_of(model, batch(rank, 3)).backward()
    return {
        "failure": failure,
        "nan": grads_nan,
        "unchanged": unchanged,
        "iteration": iteration,
        "next": state.iteration,
        "finite": all(bool(torch.isfinite(p.grad.to_local()).all()) for p in model.parameters()),
    }


def recovered_backward(accumulated: bool) -> dict:
    """Three Linears: the first an FSDP module, the others the root's (or each one its own, if
    `accumulated`); at the second backward rank 1's gradient of the last one's weight is NaN
    (after a micro-batch accumulated without sync, if `accumulated`). After the documented
    recovery the next backward's gradients are those of a backward on fresh gradients. The
    first Linear, not reduced when the backward raised, kept that backward's gradients on its
    unsharded parameters, and the next backward added its own to them; the accumulated
    micro-batch's stayed where FSDP keeps them after resharding."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(5, 6), torch.nn.Tanh(), torch.nn.Linear(6, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3)
    )
    mesh = DeviceMesh.from_group(group((0, 1, 2, 3)), "cpu")
    for layer in (model[0], model[2], model[4], model) if accumulated else (model[0], model):
        fully_shard(layer, mesh=mesh)
    compcomm.fsdp.compress(model, start_iter=100)
    loss_of(model, batch(rank, 0)).backward()
    model.zero_grad()
    hooks: list = []

    def nan_once(grad: torch.Tensor) -> torch.Tensor:
        hooks.pop().remove()  # the unsharded parameter is the same object at every backward
        return grad * float("nan")

    if accumulated:
        model.set_requires_gradient_sync(False)
        loss_of(model, batch(rank, 5)).backward()
        model.set_requires_gradient_sync(True)
    armed = model[4].register_forward_pre_hook(lambda m, _: hooks.append(m.weight.register_hook(nan_once)))
    loss = loss_of(model, batch(rank, 1))
    armed.remove()
    if rank != 1:
        hooks.pop().remove()
    failure = caught(loss.backward)
    model.reset_iter_state()
    model.zero_grad()
    runs = []
    for _ in range(2):
        loss_of(model, batch(rank, 2)).backward()
        runs.append([p.grad.to_local().clone() for p in model.parameters()])
        model.zero_grad()
    return {"failure": failure, "fresh": all(torch.equal(a, b) for a, b in zip(*runs))}


@pytest.mark.parametrize("accumulated", [False, True])
def test_the_backward_after_a_nonfinite_one_starts_from_fresh_gradients(pool, accumulated):
    for r in pool.run(recovered_backward, accumulated):
        assert r["failure"] is not None and r["failure"][0] == "NonFiniteError", r
        assert r["fresh"], r


def detour_taken_by_one_replica() -> dict:
    """HSDP 2x2: `Detour`'s middle module run by replica 0 and not by replica 1 (its forward's
    `step` 0 runs it), then by both, twice."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    rank = dist.get_rank()
    model, mesh = Detour(), DeviceMesh.from_group(group(SHARDS["2x2"][rank // 2]), "cpu")
    for layer in (model.first, model.middle, model.last, model):
        fully_shard(layer, mesh=mesh)
    state = compcomm.fsdp.compress(model, start_iter=1, replicate_group=group(REPLICAS["2x2"][rank % 2]))
    failure = caught(lambda: model(batch(rank, 0), 0 if rank < 2 else 1).backward())
    model.reset_iter_state()  # as FSDP asks after any exception in backward
    model.zero_grad()
    after = []
    for step in (1, 2):
        model(batch(rank, step), 0).backward()
        torch.optim.SGD(model.parameters(), lr=0.05).step()
        model.zero_grad()
        after.append([p.to_local().detach().numpy().tobytes() for p in model.parameters()])
    return {"failure": failure, "iteration": state.iteration, "after": after}


def test_hsdp_a_module_one_replica_skips_is_refused_on_every_rank(pool):
    """The replica that skipped the middle module reduces it at the end of the backward, the
    other in its place: their averages across replicas pair different modules. Every rank
    raises the same ValueError (FSDP2's own HSDP hangs there; from a probe), and after FSDP's
    reset_iter_state the replicas train on, bitwise equal."""
    res = pool.run(detour_taken_by_one_replica)
    assert all(r["failure"] is not None and r["failure"][0] == "ValueError" for r in res), [r["failure"] for r in res]
    assert "ranks passed tensors of different sizes" in res[0]["failure"][1]
    assert len({r["failure"][1] for r in res}) == 1, "ranks raised different errors"
    assert all(r["iteration"] == 2 for r in res)
    assert res[0]["after"] == res[2]["after"] and res[1]["after"] == res[3]["after"]


@pytest.mark.parametrize("where", ["input", "first"])
@pytest.mark.parametrize("hsdp", [False, True])
def test_nonfinite_raises_on_every_rank_and_training_goes_on(pool, hsdp, where):
    res = pool.run(poisoned, "raise", hsdp, where)
    for r in res:
        assert r["failure"] is not None and r["failure"][0] == "NonFiniteError", r["failure"]
        assert r["iteration"] == 2, "a failed backward is not counted"
        assert r["next"] == 3 and r["finite"], "the next backward reduces normally"
        assert all(r["unchanged"].values()), "a failed backward leaves every error state as it was"


@pytest.mark.parametrize("where", ["input", "first"])
@pytest.mark.parametrize("hsdp", [False, True])
def test_nonfinite_propagate_gives_nan_everywhere_and_leaves_no_trace(pool, hsdp, where):
    res = pool.run(poisoned, "propagate", hsdp, where)
    for r in res:
        assert r["failure"] is None
        assert len(r["nan"]) == 4 and all(r["nan"]), "every gradient comes back NaN (only the failing module's did)"
        assert all(r["unchanged"].values()), "a skipped backward leaves every error state as it was"
        assert r["iteration"] == 2 and r["next"] == 3 and r["finite"]


# ----------------------------------------------------------------- checkpoints


def scaled_against_unscaled(hsdp: bool) -> tuple[bytes, bytes, float | None]:
    """1-bit training twice side by side, once plainly and once on a GradScaler's scaled loss
    whose scale doubles after every step, compress given the scaler: the parameters of both and
    the scale the errors are kept in."""
    import torch.distributed as dist

    rank = dist.get_rank()
    members = SHARDS["2x2"][rank // 2] if hsdp else (0, 1, 2, 3)
    replicas = group(REPLICAS["2x2"][rank % 2]) if hsdp else None
    plain, scaled = shard(make_model(), members), shard(make_model(), members)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4, growth_interval=1)
    compcomm.fsdp.compress(plain, start_iter=0, replicate_group=replicas)
    state = compcomm.fsdp.compress(scaled, start_iter=0, replicate_group=replicas, grad_scaler=scaler)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.05, momentum=0.9)
    scaled_opt = torch.optim.SGD(scaled.parameters(), lr=0.05, momentum=0.9)
    for step in range(5):
        x = batch(rank, step)
        loss_of(plain, x).backward()
        plain_opt.step()
        plain_opt.zero_grad()
        scaler.scale(loss_of(scaled, x)).backward()
        scaler.step(scaled_opt)
        scaler.update()
        scaled_opt.zero_grad()

    def raw(model: torch.nn.Module) -> bytes:
        return b"".join(p.to_local().detach().numpy().tobytes() for p in model.parameters())

    return raw(plain), raw(scaled), state.state_dict()["errors_scale"]


@pytest.mark.parametrize("hsdp", [False, True])
def test_given_the_grad_scaler_errors_follow_its_scale(pool, hsdp):
    """The carried errors rescaled by each power-of-two change of loss scale: bitwise the run
    whose loss was never scaled (before, errors carried across a change counted it once too
    much, and the runs parted)."""
    for plain, scaled, errors_scale in pool.run(scaled_against_unscaled, hsdp):
        assert scaled == plain and errors_scale == 2.0**8  # the scale of the last backward


def resume(gathered: bool, detour: bool = False) -> tuple[bytes, bytes]:
    """Train 4 steps straight, and 2 + save + load into a fresh model and state + 2: the same bits
    (`detour`: the `Detour` model, 6 steps, all 1-bit)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    rank = dist.get_rank()
    steps = 6 if detour else 4

    def build():
        if detour:
            model: torch.nn.Module = Detour()
            for module in (model.first, model.middle, model.last, model):
                fully_shard(module, mesh=DeviceMesh.from_group(group((0, 1, 2, 3)), "cpu"))
        else:
            model = shard(make_model(), (0, 1, 2, 3))
        state = compcomm.fsdp.compress(model, start_iter=0 if detour else 1)
        return model, state, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def train(model, opt, steps):
        for step in steps:
            (model(batch(rank, step), step) if detour else loss_of(model, batch(rank, step))).backward()
            opt.step()
            opt.zero_grad()

    def raw(model):
        return b"".join(p.to_local().detach().numpy().tobytes() for p in model.parameters())

    model, state, opt = build()
    train(model, opt, range(steps))
    straight = raw(model)
    model, state, opt = build()
    train(model, opt, range(steps // 2))
    saved = io.BytesIO()
    torch.save(
        {
            "model": {k: v.to_local().clone() for k, v in model.state_dict().items()},
            "opt": opt.state_dict(),
            "comm": state.gathered_state_dict() if gathered else state.state_dict(),
        },
        saved,
    )
    saved.seek(0)
    loaded = torch.load(saved, weights_only=False)
    model, state, opt = build()
    with torch.no_grad():
        for k, v in model.state_dict().items():
            v.to_local().copy_(loaded["model"][k])
    opt.load_state_dict(loaded["opt"])
    state.load_state_dict(loaded["comm"])
    train(model, opt, range(steps // 2, steps))
    return straight, raw(model)


@pytest.mark.parametrize("gathered", [False, True])
def test_checkpoint_resumes_bit_for_bit(pool, gathered):
    for straight, resumed in pool.run(resume, gathered):
        assert straight == resumed


def foreign_state() -> tuple[str, str] | None:
    import torch.distributed as dist

    rank = dist.get_rank()
    model = shard(make_model(), (0, 1, 2, 3))
    state = compcomm.fsdp.compress(model, start_iter=0)
    loss_of(model, batch(rank, 0)).backward()
    blob = [state.state_dict()]
    dist.broadcast_object_list(blob, src=0, group=group(4))
    return caught(state.load_state_dict, blob[0])


def test_rank0_state_loaded_everywhere_raises_on_every_rank(pool):
    for failure in pool.run(foreign_state):
        assert failure is not None and failure[0] == "ValueError" and "rank 0's state" in failure[1], failure


class Pair(torch.nn.Module):
    """Two weights of one shape, registered in either order."""

    def __init__(self, swapped: bool) -> None:
        super().__init__()
        torch.manual_seed(2)
        a, b = torch.nn.Parameter(torch.randn(8, 8)), torch.nn.Parameter(torch.randn(8, 8))
        if swapped:
            self.b, self.a = b, a
        else:
            self.a, self.b = a, b

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.a).sum() - 3 * (x @ self.b).sum()


def other_saves() -> dict:
    """Refused loads: rank 2 loads an earlier iteration's per-rank file than the others, or one
    of another start_iter (it would switch to 1 bit at another backward than they); a state
    of a model whose modules have the same names but other shapes, or the same shapes laid out
    otherwise (sharded by columns, parameters registered in another order). A model built anew
    on an equal but new mesh is accepted."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    rank = dist.get_rank()
    model = shard(make_model(), (0, 1, 2, 3))
    state = compcomm.fsdp.compress(model, start_iter=0)
    loss_of(model, batch(rank, 0)).backward()
    earlier = state.state_dict()
    loss_of(model, batch(rank, 1)).backward()
    out = {"stale": caught(state.load_state_dict, earlier if rank == 2 else state.state_dict())}
    later = state.state_dict()
    if rank == 2:
        later["start_iter"] = 5
    out["start_iter"] = caught(state.load_state_dict, later)
    torch.manual_seed(1)
    wide = torch.nn.Sequential(torch.nn.Linear(5, 9), torch.nn.Tanh(), torch.nn.Linear(9, 3))
    mesh = DeviceMesh.from_group(group((0, 1, 2, 3)), "cpu")
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    for layer in wide:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(wide, mesh=mesh)
    out["reshaped"] = caught(compcomm.fsdp.compress(wide, start_iter=0).load_state_dict, state.state_dict())
    out["rebuilt"] = caught(compcomm.fsdp.compress, shard(make_model(), (0, 1, 2, 3)), start_iter=0)
    for case, variants in (
        ("placement", [(False, Shard(0)), (False, Shard(1))]),
        ("order", [(False, None), (True, None)]),
    ):
        states = []  # the same parameters laid out otherwise: other elements in each row of the reduce-scatter
        for swapped, placement in variants:
            pair = Pair(swapped)
            fully_shard(pair, mesh=mesh, shard_placement_fn=None if placement is None else lambda p, s=placement: s)
            states.append(compcomm.fsdp.compress(pair, start_iter=0))
            pair(torch.randn(2, 8)).backward()
        out[case] = caught(states[1].load_state_dict, states[0].state_dict())
    return out


def test_other_saves_and_layouts_are_refused_on_every_rank(pool):
    results = pool.run(other_saves)
    for res in results:
        assert res["stale"][0] == "ValueError" and "different saves" in res["stale"][1], res["stale"]
        assert res["start_iter"][0] == "ValueError" and "different saves" in res["start_iter"][1], res
        assert res["reshaped"][0] == "ValueError" and "shapes" in res["reshaped"][1], res["reshaped"]
        assert res["rebuilt"] is None, res["rebuilt"]
        for case in ("placement", "order"):  # loaded silently before: the rows hold other elements
            assert res[case][0] == "ValueError" and "laid out its parameters" in res[case][1], res[case]


def requires_grad_damaged(case: str) -> tuple[tuple[str, str] | None, bool]:
    """Rank 1's state has its `requires_grad` entry damaged: read after the agreement, it raised
    there alone (a list where a dict belongs) with the iteration and some modules' errors already
    loaded, or (a flag flipped, one missing) loaded and failed every backward after."""
    import torch.distributed as dist

    rank = dist.get_rank()
    model = shard(make_model(), (0, 1, 2, 3))
    state = compcomm.fsdp.compress(model, start_iter=0)
    for step in range(2):
        loss_of(model, batch(rank, step)).backward()
    saved = state.state_dict()
    before = repr(state.state_dict())
    if rank == 1:
        layouts = saved["requires_grad"]
        name = next(iter(layouts))
        if case == "a list":
            saved["requires_grad"] = list(layouts.values())
        elif case == "flipped":
            layouts[name] = [not flag for flag in layouts[name]]
        else:
            layouts[name] = layouts[name][1:]
    return caught(state.load_state_dict, saved), repr(state.state_dict()) == before


@pytest.mark.parametrize(
    "case,says",
    [
        ("a list", "rank 1: ValueError: the state's requires_grad does not name"),
        ("flipped", "different saves"),
        ("short", "rank 1: ValueError: the state's requires_grad of FSDP module"),
    ],
)
def test_a_damaged_requires_grad_entry_is_refused_on_every_rank_with_nothing_loaded(pool, case, says):
    for failure, kept in pool.run(requires_grad_damaged, case):
        assert failure is not None and failure[0] == "ValueError" and says in failure[1], failure
        assert kept


def another_mesh_loaded(mesh: str) -> dict:
    """An HSDP state of 2 replicas x 2 shards, with 1-bit errors, loaded into the same model on
    4 shards x 1 replica or 1 shard x 4 replicas: the world size, the mode, the module names and
    the parameter shapes all match, so it loaded, the live errors were replaced, and the next
    backward failed with a misleading hint (reset() the ErrorFeedback). Refused at the load now,
    nothing changed. So is a state whose iteration or start_iter is negative."""
    import torch.distributed as dist

    rank = dist.get_rank()
    model = shard(make_model(), SHARDS["2x2"][rank // 2])
    state = compcomm.fsdp.compress(model, start_iter=0, replicate_group=group(REPLICAS["2x2"][rank % 2]))
    loss_of(model, batch(rank, 0)).backward()
    saved = state.state_dict()
    shards, replicas = {"4x1": ((0, 1, 2, 3), (rank,)), "1x4": ((rank,), (0, 1, 2, 3))}[mesh]
    other = shard(make_model(), shards)
    other_state = compcomm.fsdp.compress(other, start_iter=0, replicate_group=group(replicas))
    loss_of(other, batch(rank, 0)).backward()
    before = {k: v.worker_error.clone() for k, v in other_state.error_feedback.items() if v.initialized}
    out = {"mesh": caught(other_state.load_state_dict, saved)}
    after = {k: v.worker_error for k, v in other_state.error_feedback.items() if v.initialized}
    out["unchanged"] = before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    for key in ("iteration", "start_iter"):
        out[key] = caught(state.load_state_dict, dict(saved, **{key: -1}))
    out["after"] = caught(lambda: loss_of(other, batch(rank, 1)).backward())
    return out


def own_state_over_a_hierarchical_backend() -> tuple[tuple[str, str] | None, tuple[str, str] | None]:
    """HSDP whose average across replicas runs over a hierarchical backend (2 nodes of 2): its
    errors are of the part each rank reduces across the nodes (2 ranks), not of the 4 replicas.
    The first version of the mesh check refused the run's own state; a flat backend's state is
    another layout of the ranks and is refused."""
    import torch.distributed as dist

    rank = dist.get_rank()

    def build(backend):
        model = shard(make_model(), (rank,))
        return model, compcomm.fsdp.compress(model, start_iter=0, replicate_group=group(4), backend=backend)

    model, state = build(compcomm.backends.get("hierarchical", local_world_size=2))
    for step in range(2):
        loss_of(model, batch(rank, step)).backward()
    flat_model, flat_state = build(None)
    loss_of(flat_model, batch(rank, 0)).backward()
    return caught(state.load_state_dict, state.state_dict()), caught(state.load_state_dict, flat_state.state_dict())


def test_hsdp_over_a_hierarchical_backend_reloads_its_own_state(pool):
    for own, flat in pool.run(own_state_over_a_hierarchical_backend):
        assert own is None, own
        assert flat is not None and flat[0] == "ValueError" and "another mesh" in flat[1], flat


@pytest.mark.parametrize("mesh", ["4x1", "1x4"])
def test_a_state_of_another_mesh_of_as_many_ranks_is_refused_at_the_load(pool, mesh):
    for r in pool.run(another_mesh_loaded, mesh):
        assert r["mesh"] is not None and r["mesh"][0] == "ValueError" and "another mesh" in r["mesh"][1], r
        assert r["unchanged"] and r["after"] is None, r
        for key in ("iteration", "start_iter"):
            assert r[key] is not None and f"{key} must be an integer >= 0" in r[key][1], r


# ----------------------------------------------------------------- misuse


def misuse(case: str) -> tuple[str, str] | None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    rank = dist.get_rank()
    if case == "no_fsdp":
        return caught(compcomm.fsdp.compress, make_model())
    if case == "2d_mesh":
        mesh = DeviceMesh("cpu", torch.arange(4).view(2, 2), mesh_dim_names=("replicate", "shard"))
        model = make_model()
        fully_shard(model, mesh=mesh)
        return caught(compcomm.fsdp.compress, model)
    if case == "overlapping_group":
        model = shard(make_model(), (0, 1, 2, 3))
        return caught(compcomm.fsdp.compress, model, replicate_group=group((0, 1) if rank < 2 else (2, 3)))
    if case == "twice":
        model = shard(make_model(), (0, 1, 2, 3))
        compcomm.fsdp.compress(model)
        return caught(compcomm.fsdp.compress, model)
    if case in ("nonfinite_differs", "start_iter_differs"):  # hung at the first such backward before
        setting = {"nonfinite": "propagate" if rank == 3 else "raise"}
        if case == "start_iter_differs":
            setting = {"start_iter": 3 if rank == 3 else 1}
        return caught(compcomm.fsdp.compress, shard(make_model(), (0, 1, 2, 3)), **setting)
    if case == "start_iter_bad_on_one_rank":  # the other ranks hung in the settings' agreement before
        return caught(compcomm.fsdp.compress, shard(make_model(), (0, 1, 2, 3)), start_iter=-1 if rank == 3 else 1)
    if case == "backend_bad_on_one_rank":
        return caught(compcomm.fsdp.compress, shard(make_model(), (0, 1, 2, 3)), backend=3 if rank == 1 else None)
    if case == "start_iter_bad_on_one_rank_over_shm":  # the refused rank built another transport: hung
        model = shard(make_model(), (0, 1, 2, 3))
        return caught(compcomm.fsdp.compress, model, backend="shm", start_iter=-1 if rank == 3 else 1)
    if case == "start_iter_bad_on_one_rank_hsdp_backend":  # the others built their own replicas' world: hung
        model = shard(make_model(), SHARDS["2x2"][rank // 2])
        replicas = group(REPLICAS["2x2"][rank % 2])
        backend = compcomm.backends.get("gloo", group=replicas)
        return caught(
            compcomm.fsdp.compress, model, replicate_group=replicas, backend=backend, start_iter=-1 if rank == 2 else 1
        )
    if case == "backend_unknown_on_one_rank":
        return caught(compcomm.fsdp.compress, shard(make_model(), (0, 1, 2, 3)), backend="nope" if rank == 1 else None)
    if case == "backend_nccl_on_one_rank":  # a RuntimeError on CPU: it was raised there alone
        return caught(compcomm.fsdp.compress, shard(make_model(), (0, 1, 2, 3)), backend="nccl" if rank == 1 else None)
    if case == "backend_differs":
        return caught(compcomm.fsdp.compress, shard(make_model(), (0, 1, 2, 3)), backend="shm" if rank == 1 else None)
    if case in ("intra_bad_on_one_rank", "intra_differs"):  # rank 2: an unknown intra, or another valid one
        model = shard(make_model(), SHARDS["2x2"][rank // 2])
        mine = ("gloo" if case == "intra_bad_on_one_rank" else None) if rank == 2 else "shm"
        return caught(compcomm.fsdp.compress, model, replicate_group=group(REPLICAS["2x2"][rank % 2]), intra=mine)
    if case == "intra_sizes_differ":  # one replica's shm reduce-scatter refused it; the other waited
        model = shard(make_model(), SHARDS["2x2"][rank // 2])
        compcomm.fsdp.compress(model, replicate_group=group(REPLICAS["2x2"][rank % 2]), intra="shm")
        if rank == 0:
            model[2].bias.requires_grad_(False)  # FSDP leaves it out of this rank's reduce-scatter
        return caught(lambda: loss_of(model, batch(rank, 0)).backward())
    if case == "intra_in_fsdp_mode":
        return caught(compcomm.fsdp.compress, shard(make_model(), (0, 1, 2, 3)), intra="shm")
    if case == "intra_unknown":
        model = shard(make_model(), SHARDS["2x2"][rank // 2])
        return caught(compcomm.fsdp.compress, model, replicate_group=group(REPLICAS["2x2"][rank % 2]), intra="gloo")
    if case == "bad_backend":
        model = shard(make_model(), (0, 1, 2, 3))
        return caught(
            compcomm.fsdp.compress,
            model,
            backend=compcomm.backends.get("gloo", group=group((0, 2)) if rank in (0, 2) else group((1, 3))),
        )
    raise AssertionError(case)


@pytest.mark.parametrize(
    "case, error, words",
    [
        ("no_fsdp", "ValueError", "fully_shard"),
        ("2d_mesh", "ValueError", "replicate_group=mesh['replicate']"),
        ("overlapping_group", "ValueError", "shares ranks"),
        ("twice", "ValueError", "already"),
        ("bad_backend", "ValueError", "does not match"),
        ("intra_in_fsdp_mode", "ValueError", "applies to HSDP"),
        ("intra_unknown", "ValueError", "intra must be None or 'shm'"),
        ("nonfinite_differs", "ValueError", "ranks passed different nonfinite"),
        ("start_iter_differs", "ValueError", "ranks passed different start_iter"),
        ("start_iter_bad_on_one_rank", "ValueError", "rank 3: start_iter must be an integer >= 0, got -1"),
        ("backend_bad_on_one_rank", "TypeError", "rank 1: backend must be a name"),
        ("start_iter_bad_on_one_rank_over_shm", "ValueError", "rank 3: start_iter must be an integer >= 0"),
        ("start_iter_bad_on_one_rank_hsdp_backend", "ValueError", "rank 2: start_iter must be an integer >= 0"),
        ("backend_unknown_on_one_rank", "ValueError", "rank 1: unknown backend 'nope'"),
        ("backend_nccl_on_one_rank", "RuntimeError", "rank 1: the nccl backend"),
        ("backend_differs", "ValueError", "ranks passed different backend"),
        ("intra_differs", "ValueError", "ranks passed different intra"),
        ("intra_bad_on_one_rank", "ValueError", "rank 2: intra must be None or 'shm'"),
        ("intra_sizes_differ", "ValueError", "ranks made different calls"),
    ],
)
def test_misuse_is_a_clear_error_on_every_rank(pool, case, error, words):
    for failure in pool.run(misuse, case):
        assert failure is not None and failure[0] == error and words in failure[1], failure
        assert not re.search(r"(rank \d+: )\1", failure[1]), failure  # each agreement names the rank once


def wire(world: int) -> tuple[int, int]:
    """Bytes the compressed backend sent for one compressed backward, and the module sizes."""
    model = shard(torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 256)), tuple(range(world)))
    state = compcomm.fsdp.compress(model, start_iter=1)
    import torch.distributed as dist

    x = batch(dist.get_rank(), 0).repeat(1, 52)[:, :256]
    model(x).sum().backward()
    model.zero_grad()
    before = state.bytes_sent
    model(x).sum().backward()
    return state.bytes_sent - before, sum(p.numel() for p in model.parameters())


def test_reduce_scatter_wire_bytes_within_5_percent_of_the_one_bit_ideal(pool):
    for sent, numel in pool.run(wire, 4):
        padded = numel  # every dim 0 here is a multiple of 4
        ideal = 3 / 4 * padded / 8
        assert ideal <= sent <= 1.05 * ideal, (sent, ideal)

"""The misuses a new user falls into, each a clear error or warning on every rank: a compcomm
optimizer given a DDP-wrapped model (or one wrapped after it was built), the 1-bit DDP hook
behind an Adam-like optimizer, and a new ErrorFeedback made for every call."""

from __future__ import annotations

import copy
import gc
import warnings
import weakref

import pytest
import torch

import compcomm
from compcomm.optim import OnebitAdam, OnebitLamb, ZeroOneAdam

from rankpool import caught

OPTIMIZERS = {"adam": OnebitAdam, "lamb": OnebitLamb, "zeroone": ZeroOneAdam}


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Linear(8, 2))


def optimizer_on_ddp(name: str, unwrapped: bool) -> tuple[str, str] | None:
    net = model()
    ddp = torch.nn.parallel.DistributedDataParallel(net)
    params = net.parameters() if unwrapped else ddp.parameters()
    return caught(OPTIMIZERS[name], params)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("unwrapped", [False, True])
def test_compcomm_optimizer_on_a_ddp_wrapped_model_is_an_error(pool, name, unwrapped):
    """The parameters are DDP's whether taken from the wrapper or from the module it wraps."""
    for failure in pool.run(optimizer_on_ddp, name, unwrapped):
        assert failure is not None and failure[0] == "ValueError" and "DistributedDataParallel" in failure[1]


def wrapped_after_building(name: str) -> tuple[tuple[str, str] | None, bool]:
    """The optimizer built on the bare module, which is then wrapped in DDP (construction
    cannot see that): the first step refuses, with the parameters as they were."""
    net = model()
    if name == "diloco":
        opt = compcomm.optim.DiLoCo(net.parameters(), torch.optim.SGD(net.parameters(), lr=0.1), sync_every=2)
    else:
        opt = OPTIMIZERS[name](net.parameters())
    ddp = torch.nn.parallel.DistributedDataParallel(net)
    before = [p.detach().clone() for p in net.parameters()]
    ddp(torch.randn(4, 6)).sum().backward()
    failure = caught(opt.step)
    return failure, all(torch.equal(b, p) for b, p in zip(before, net.parameters()))


@pytest.mark.parametrize("name", [*OPTIMIZERS, "diloco"])
def test_a_model_wrapped_in_ddp_after_the_optimizer_was_built_is_refused_at_the_first_step(pool, name):
    for failure, unchanged in pool.run(wrapped_after_building, name):
        assert failure is not None and failure[0] == "ValueError", failure
        assert "wrapped in DistributedDataParallel after" in failure[1] and unchanged


def ddp_made_before_and_after_the_first_check() -> list[tuple[str, str] | None]:
    """As in a fresh process, where no check has run yet: a DDP model made before the first
    check (found among every object), one made after it (noted as it takes its module), a bare
    model, and a deep copy of a DDP model (found among every object at construction)."""
    from compcomm.optim import replicas

    for handle in replicas._noting:
        handle.remove()
    replicas._noting.clear()
    replicas._DDP_MODULES.clear()
    before = model()
    kept = [torch.nn.parallel.DistributedDataParallel(before)]
    failures = [caught(OnebitAdam, before.parameters())]
    after = model()
    kept.append(torch.nn.parallel.DistributedDataParallel(after))
    failures.append(caught(OnebitAdam, after.parameters()))
    failures.append(caught(OnebitAdam, model().parameters()))
    copied = copy.deepcopy(kept.pop())  # a copy sets its attributes without the hook
    failures.append(caught(OnebitAdam, copied.module.parameters()))
    return failures


def test_ddp_models_made_before_and_after_the_first_check_are_both_seen(pool):
    """The check no longer walks every object of the process at the first step (it took most of
    an optimizer's construction): it must still see a DDP model made before its first run, one
    made after it, and at construction a copy of one."""
    for before, after, bare, copied in pool.run(ddp_made_before_and_after_the_first_check):
        assert before is not None and "DistributedDataParallel" in before[1], before
        assert after is not None and "DistributedDataParallel" in after[1], after
        assert bare is None
        assert copied is not None and "DistributedDataParallel" in copied[1], copied


def optimizer_without_ddp() -> tuple[str, str] | None:
    return caught(OnebitAdam, model().parameters())


def test_the_same_model_without_ddp_is_fine(pool):
    assert pool.run(optimizer_without_ddp) == [None] * 4


def hook_behind(optimizer: str) -> list[str]:
    """Three steps of DDP + the 1-bit hook + `optimizer`: the warnings the hook gave."""
    import torch.distributed as dist

    net = model()
    ddp = torch.nn.parallel.DistributedDataParallel(net)
    ddp.register_comm_hook(compcomm.ddp.OnebitHookState(start_iter=1), compcomm.ddp.onebit_hook)
    opt = {"sgd": torch.optim.SGD, "adamw": torch.optim.AdamW}[optimizer](ddp.parameters(), lr=0.01)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for step in range(3):
            torch.manual_seed(dist.get_rank() * 10 + step)
            ddp(torch.randn(4, 6)).sum().backward()
            opt.step()
            opt.zero_grad()
    return [str(w.message) for w in seen if "onebit_hook" in str(w.message)]


def test_hook_warns_once_behind_an_adam_like_optimizer(pool):
    for messages in pool.run(hook_behind, "adamw"):
        assert len(messages) == 1 and "AdamW" in messages[0] and "OnebitAdam" in messages[0]


def test_hook_behind_sgd_says_nothing(pool):
    assert pool.run(hook_behind, "sgd") == [[]] * 4


def test_import_from_the_folder_above_a_checkout_named_compcomm(tmp_path):
    """From the folder that holds a checkout named `compcomm`, Python finds the checkout's folder
    first; `import compcomm` must still give the package, backends included."""
    import subprocess
    import sys
    from pathlib import Path

    (tmp_path / "compcomm").symlink_to(Path(__file__).resolve().parents[1], target_is_directory=True)
    code = (
        "import compcomm, torch; t = torch.ones(9); "
        "compcomm.compressed_allreduce(t, compcomm.ErrorFeedback(), backend=compcomm.backends.get('local')); "
        "print(compcomm.__file__.endswith('compcomm/compcomm/__init__.py'), float(t.sum()))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "9.0"]


def unequal_start(name: str) -> tuple[bytes, list[str]]:
    """Ranks seeded differently (a forgotten seed): after the first step every rank holds the
    same parameters, and every rank was told."""
    import torch.distributed as dist

    rank = dist.get_rank()
    torch.manual_seed(rank)
    net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Linear(8, 2))
    opt = OPTIMIZERS[name](net.parameters(), lr=0.01)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for step in range(2):
            torch.manual_seed(100 + rank * 10 + step)
            net(torch.randn(4, 6)).sum().backward()
            opt.step()
            opt.zero_grad()
    raw = b"".join(p.detach().numpy().tobytes() for p in net.parameters())
    return raw, [str(w.message) for w in seen if "differed" in str(w.message)]


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_ranks_started_from_different_parameters_are_made_equal_with_a_warning(pool, name):
    res = pool.run(unequal_start, name)
    assert len({r[0] for r in res}) == 1, "parameters differ across ranks after the first steps"
    assert all(len(r[1]) == 1 for r in res), [r[1] for r in res]


DROPPED_WARNING = "each served one call and were dropped"


def error_feedback_habits() -> dict[str, list[str]]:
    """Three steps of each way of holding ErrorFeedbacks: the dropped-instance warnings each gave.
    `one_per_call` is the mistake; the others are right, and so are the library's own
    instances (OnebitAdam's, the hook's)."""

    def dropped(run) -> list[str]:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            run()
        return [str(w.message) for w in seen if DROPPED_WARNING in str(w.message)]

    grad = torch.randn(1000, generator=torch.Generator().manual_seed(0))

    def one_per_call() -> None:  # the fourth fresh instance tells
        for _ in range(6):
            compcomm.compressed_allreduce(grad.clone(), compcomm.ErrorFeedback())

    def one_per_backend() -> None:  # one-off calls, compared: fewer than DroppedInstances.REPEATS
        for be in ("gloo", "gloo", "gloo"):
            compcomm.compressed_allreduce(grad.clone(), compcomm.ErrorFeedback(), backend=be)

    kept = compcomm.ErrorFeedback()
    one_per_tensor = [compcomm.ErrorFeedback() for _ in range(3)]

    def same_instance() -> None:
        for _ in range(3):
            compcomm.compressed_allreduce(grad.clone(), kept)

    def kept_list() -> None:
        for _ in range(3):
            compcomm.compressed_allreduce_coalesced([grad.clone() for _ in one_per_tensor], one_per_tensor)

    def reset_on_purpose() -> None:
        for _ in range(3):
            compcomm.compressed_allreduce(grad.clone(), kept)
            kept.reset()

    def runs_of_kept_instances() -> None:  # each run of a sweep makes its own, in a helper, and keeps them
        def make() -> list[compcomm.ErrorFeedback]:
            return [compcomm.ErrorFeedback() for _ in range(3)]

        for _ in range(3):
            efs = make()
            for _ in range(2):
                compcomm.compressed_allreduce_coalesced([grad.clone() for _ in efs], efs)

    def refused_calls() -> None:  # calls that fail (a NaN, on purpose) leave their instances unused
        bad = grad.clone()
        bad[0] = float("nan")
        for _ in range(6):
            try:
                compcomm.compressed_allreduce(bad.clone(), compcomm.ErrorFeedback())
            except compcomm.NonFiniteError:
                pass

    def one_per_size() -> None:  # a sweep: each size's instance kept over its calls
        for size in (100, 200, 300):
            ef = compcomm.ErrorFeedback()
            for _ in range(3):
                compcomm.compressed_allreduce(grad[:size].clone(), ef)

    def optimizer() -> None:
        net = model()
        opt = OnebitAdam(net.parameters(), lr=1e-3, freeze_step=1)
        for _ in range(3):
            net(torch.randn(4, 6)).sum().backward()
            opt.step()
            opt.zero_grad()

    runs = {
        "one_per_call": one_per_call,
        "same_instance": same_instance,
        "kept_list": kept_list,
        "reset_on_purpose": reset_on_purpose,
        "one_per_size": one_per_size,
        "runs_of_kept_instances": runs_of_kept_instances,
        "refused_calls": refused_calls,
        "one_per_backend": one_per_backend,
        "optimizer": optimizer,
    }
    return {name: dropped(run) for name, run in runs.items()}


def test_a_new_error_feedback_per_call_warns_once_and_kept_ones_do_not(pool):
    """A fresh ErrorFeedback per call runs and averages, but feeds no error back: a warning
    naming the place, once; instances kept (one, one per tensor, one per size of a sweep) and
    the library's own say nothing."""
    for seen in pool.run(error_feedback_habits):
        assert len(seen["one_per_call"]) == 1, seen
        assert "test_guards.py" in seen["one_per_call"][0] and "outside the loop" in seen["one_per_call"][0]
        assert {name: found for name, found in seen.items() if name != "one_per_call"} == {
            "same_instance": [],
            "kept_list": [],
            "reset_on_purpose": [],
            "one_per_size": [],
            "runs_of_kept_instances": [],
            "refused_calls": [],
            "one_per_backend": [],
            "optimizer": [],
        }


def test_the_dropped_instance_warning_never_raises_from_a_call(capfd):
    """Turned into an error (-W error), it would raise on one rank before the agreement that the
    others wait in: it goes to stderr instead, and the call runs (a world of one here)."""
    grad = torch.randn(100, generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(5):
            compcomm.compressed_allreduce(grad.clone(), compcomm.ErrorFeedback(tag="per call"))
    assert "RuntimeWarning: compcomm: an ErrorFeedback made at per call starts from zero" in capfd.readouterr().err


def test_a_tag_that_is_not_a_string_is_refused_where_the_error_feedback_is_made():
    """It failed inside the first call's agreement (an AttributeError of `encode`), on every rank."""
    with pytest.raises(TypeError, match="tag must be a string"):
        compcomm.ErrorFeedback(tag=["x"])


def error_feedback_in_a_cycle() -> tuple[int, int]:
    """ErrorFeedbacks of the caller's that point back at themselves (through an owner that
    holds them), each used for one call or for two, then dropped: how many of each survive a
    collection."""
    grad = torch.randn(1000, generator=torch.Generator().manual_seed(0))

    class Owner:
        pass

    survivors = []
    for calls in (1, 2):
        alive = []
        for _ in range(3):
            owner = Owner()
            owner.ef = compcomm.ErrorFeedback(tag=f"cycle {calls}")
            owner.ef.owner = owner
            for _ in range(calls):
                compcomm.compressed_allreduce(grad.clone(), owner.ef)
            alive.append(weakref.ref(owner.ef))
            del owner
        gc.collect()
        survivors.append(sum(ref() is not None for ref in alive))
    return survivors[0], survivors[1]


def test_an_error_feedback_in_a_cycle_of_the_callers_is_collected(pool):
    """The dropped-instance count's finalizer held the instance's own dict: whatever it led to
    stayed alive, and through an attribute pointing back, the instance and its error buffers."""
    assert pool.run(error_feedback_in_a_cycle) == [(0, 0)] * 4

"""The misuses a new user falls into, each a clear error or warning on every rank: a compcomm
optimizer given a DDP-wrapped model (or one wrapped after it was built), and the 1-bit DDP hook
behind an Adam-like optimizer."""

from __future__ import annotations

import warnings

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

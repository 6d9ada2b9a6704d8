"""Backend selection, sub-groups, shapes, byte counting and checkpointing on real gloo ranks."""

from __future__ import annotations

import io
import subprocess
import sys

import numpy as np
import pytest
import torch

import compcomm
from compcomm.layout import padded_size

from rankpool import group


def seeded(rank: int, numel: int, step: int = 0) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(100 * rank + step))


def auto_and_named() -> dict:
    """backend=None inside an initialized gloo group picks gloo; results match the named one."""
    import torch.distributed as dist

    rank = dist.get_rank()
    a, b = seeded(rank, 77), seeded(rank, 77)
    compcomm.compressed_allreduce(a, compcomm.ErrorFeedback())
    compcomm.compressed_allreduce(b, compcomm.ErrorFeedback(), backend="gloo")
    picked = compcomm.backends.resolve(None, a)
    return {"same": torch.equal(a, b), "picked": picked.name, "world": picked.world_size}


def test_auto_backend_picks_the_process_group(pool):
    results = pool.run(auto_and_named)
    assert all(r == {"same": True, "picked": "gloo", "world": 4} for r in results)


def test_without_launcher_world_size_one_is_exact_up_to_one_bit_code():
    t = torch.randn(5, 3)
    original = t.clone()
    ef = compcomm.ErrorFeedback()
    out = compcomm.compressed_allreduce(t, ef)
    assert compcomm.backends.resolve(None, t).world_size == 1
    assert out is t
    # single rank: output + worker error + server error reproduces the input
    restored = t.reshape(-1) + ef.worker_error[:15] + ef.server_error[:15]
    torch.testing.assert_close(restored, original.reshape(-1))


def subgroup_call(members: tuple[int, ...]) -> bytes | None:
    """Only the members of a non-prefix sub-group take part; the others do nothing."""
    import torch.distributed as dist

    if dist.get_rank() not in members:
        return None
    backend = compcomm.backends.get("gloo", group=group(members))
    t = seeded(dist.get_rank(), 40)
    compcomm.compressed_allreduce(t, compcomm.ErrorFeedback(), backend=backend)
    return t.numpy().tobytes()


def test_sub_groups_reduce_on_their_own(pool):
    results = pool.run(subgroup_call, (1, 3))
    assert results[0] is None and results[2] is None and results[1] == results[3]
    # The same members through world size 2 in a different group give the same numbers.
    from reference import reference_allreduce

    inputs = [seeded(r, 40).double().numpy() for r in (1, 3)]
    m = padded_size(40, 2)
    expected, _, _ = reference_allreduce(inputs, np.zeros((2, m)), np.zeros((2, m // 2)))
    np.testing.assert_allclose(np.frombuffer(results[1], dtype=np.float32), expected, rtol=1e-5, atol=1e-6)


def shapes_and_layouts() -> dict:
    """A transposed (non-contiguous) 2-D tensor gives the same numbers as its contiguous copy."""
    import torch.distributed as dist

    rank = dist.get_rank()
    base = seeded(rank, 12 * 9).view(12, 9)
    strided = base.t()
    contiguous = strided.contiguous()
    compcomm.compressed_allreduce(strided, compcomm.ErrorFeedback())
    compcomm.compressed_allreduce(contiguous, compcomm.ErrorFeedback())
    return {"equal": torch.equal(strided, contiguous), "base_written": torch.equal(base.t(), strided)}


def test_non_contiguous_tensors(pool):
    assert all(r == {"equal": True, "base_written": True} for r in pool.run(shapes_and_layouts))


def wire_bytes(numel: int) -> int:
    backend = compcomm.backends.get("gloo")
    ef = compcomm.ErrorFeedback()
    compcomm.compressed_allreduce(torch.randn(numel), ef, backend=backend)
    before = backend.bytes_sent
    compcomm.compressed_allreduce(torch.randn(numel), ef, backend=backend)
    return backend.bytes_sent - before


def test_wire_bytes_close_to_one_bit_ideal(pool):
    numel, n = 1 << 20, 4
    sent = pool.run(wire_bytes, numel)
    ideal = 2 * (n - 1) / n * padded_size(numel, n) / 8
    assert len(set(sent)) == 1
    assert ideal <= sent[0] <= 1.001 * ideal, (sent[0], ideal)
    assert sent[0] * 30 < 2 * (n - 1) / n * 4 * numel, "not ~32x below an fp32 ring allreduce"


def checkpoint_resume() -> dict:
    """Two calls, checkpoint through torch.save, resume in a fresh ErrorFeedback: same bits as never stopping."""
    import torch.distributed as dist

    rank = dist.get_rank()
    steady, resumed = compcomm.ErrorFeedback(), compcomm.ErrorFeedback()
    for step in range(2):
        compcomm.compressed_allreduce(seeded(rank, 333, step), steady)
    blob = io.BytesIO()
    torch.save(steady.state_dict(), blob)
    blob.seek(0)
    resumed.load_state_dict(torch.load(blob))
    outs = []
    for step in range(2, 5):
        a, b = seeded(rank, 333, step), seeded(rank, 333, step)
        compcomm.compressed_allreduce(a, steady)
        compcomm.compressed_allreduce(b, resumed)
        outs.append(torch.equal(a, b))
    same_state = torch.equal(steady.worker_error, resumed.worker_error) and torch.equal(
        steady.server_error, resumed.server_error
    )
    resumed.reset()
    return {"outs": outs, "state": same_state, "reset": resumed.worker_error is None}


def test_state_dict_round_trip_resumes_bit_for_bit(pool):
    assert all(r == {"outs": [True] * 3, "state": True, "reset": True} for r in pool.run(checkpoint_resume))


def test_load_state_dict_rejects_inconsistent_state():
    ef = compcomm.ErrorFeedback()
    with pytest.raises(ValueError, match="do not fit"):
        ef.load_state_dict(
            {"worker_error": torch.zeros(16), "server_error": torch.zeros(8), "numel": 10, "world_size": 1}
        )
    ef.load_state_dict(compcomm.ErrorFeedback().state_dict())
    assert ef.worker_error is None


def async_calls() -> dict:
    """Several async calls in flight, then waits: same bits as synchronous calls; errors at wait()."""
    import torch.distributed as dist

    rank = dist.get_rank()
    backend = compcomm.backends.get("gloo")
    sync = [seeded(rank, 500 + i) for i in range(3)]
    for t, ef in zip(sync, [compcomm.ErrorFeedback() for _ in sync]):
        compcomm.compressed_allreduce(t, ef, backend=backend)
    tensors = [seeded(rank, 500 + i) for i in range(3)]
    handles = [
        compcomm.compressed_allreduce(t, compcomm.ErrorFeedback(), backend=backend, async_op=True) for t in tensors
    ]
    results = [h.wait() for h in handles]
    assert all(h.is_completed() for h in handles)
    bad = seeded(rank, 10)
    if rank == 1:
        bad[0] = float("nan")
    failed = compcomm.compressed_allreduce(bad, compcomm.ErrorFeedback(), backend=backend, async_op=True)
    try:
        failed.wait()
        error = None
    except compcomm.NonFiniteError as exc:
        error = type(exc).__name__
    return {
        "same": all(torch.equal(a, b) for a, b in zip(sync, tensors)),
        "returned": all(r is t for r, t in zip(results, tensors)),
        "error": error,
    }


def test_async_op_matches_sync_and_reports_errors_at_wait(pool):
    assert all(r == {"same": True, "returned": True, "error": "NonFiniteError"} for r in pool.run(async_calls))


def fresh_python(code: str) -> subprocess.CompletedProcess:
    """`code` run by a new interpreter: imports as a fresh process sees them."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_every_documented_module_is_an_attribute_after_import_compcomm():
    """`import compcomm` then `compcomm.launch.mpirun(4)` (docs/guides/collective.md) raised
    AttributeError: launch was not imported with the package. A fresh interpreter, since this
    one's other tests import the submodules themselves."""
    code = (
        "import compcomm\n"
        "for name in ('backends', 'ddp', 'fsdp', 'launch', 'layout', 'optim'):\n"
        "    getattr(compcomm, name)\n"
        "print(compcomm.launch.mpirun.__name__)\n"
    )
    out = fresh_python(code)
    assert out.returncode == 0 and out.stdout.strip() == "mpirun", out.stderr[-2000:]


def test_fsdp_on_a_torch_without_fsdp2s_seams_says_what_it_needs():
    """A torch whose FSDP2 lacks the custom collectives (`_fsdp_api`, as before they existed)
    raised a bare ImportError from deep inside compcomm.fsdp."""
    code = (
        "import sys\n"
        "sys.modules['torch.distributed.fsdp._fully_shard._fsdp_api'] = None  # as a torch without it\n"
        "import compcomm\n"
        "try:\n"
        "    compcomm.fsdp\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    out = fresh_python(code)
    assert out.returncode == 0 and "set_custom_reduce_scatter" in out.stdout and "torch 2.13" in out.stdout, (
        out.stdout + out.stderr[-2000:]
    )


def test_fsdp_imports_without_torch_private_helpers_missing_from_older_torch():
    """compcomm.fsdp imported `collect_grad_tensors` from torch's private `_common_utils`, which
    torch 2.11 lacks: `import compcomm.fsdp` raised a bare ImportError there (seen on a GPU
    machine's torch 2.11), instead of compress saying what that torch lacks."""
    code = (
        "import torch.distributed.fsdp._common_utils as private\n"
        "if hasattr(private, 'collect_grad_tensors'):\n"
        "    del private.collect_grad_tensors  # as torch 2.11, which lacks it\n"
        "import compcomm.fsdp\n"
        "print('imported')\n"
    )
    out = fresh_python(code)
    assert out.returncode == 0 and out.stdout.strip() == "imported", out.stderr[-2000:]


def test_the_outputs_fsdp_watches_are_found_in_every_container_fsdp_looks_into():
    """compcomm.fsdp begins a backward at the gradient of a forward's output: those outputs are
    found in tensors, dicts, lists, tuples, NamedTuples and dataclasses, at any depth, once
    each, and a structure that holds itself ends the search instead of recursing forever."""
    import dataclasses
    from typing import NamedTuple

    from compcomm.fsdp.modules import grad_tensors

    a, b, c, d = (torch.ones(2, requires_grad=True) for _ in range(4))
    frozen = torch.ones(2)

    class Pair(NamedTuple):
        left: torch.Tensor
        right: object

    @dataclasses.dataclass
    class Out:
        loss: torch.Tensor
        extras: dict

    cyclic: list = [d]
    cyclic.append(cyclic)
    output = Out(a, {"pair": Pair(b, [frozen, (c,)]), "cycle": cyclic, "n": 3})
    assert {id(t) for t in grad_tensors(output)} == {id(a), id(b), id(c), id(d)}
    assert len(grad_tensors(output)) == 4
    assert grad_tensors(frozen) == [] and grad_tensors(Out) == []

"""Checks of the mpi backend, run under `mpirun -n 4 python tests/programs/mpi_checks.py OUT_DIR`.

Every rank also joins a torch.distributed gloo group (rank and size from MPI, the port chosen
by rank 0 and broadcast over MPI), so the same inputs go through gloo and MPI in one program.
Each rank writes OUT_DIR/rank<r>.json after every check: {check: {"ok", "detail", ...values}},
so that a check that fails (or a run that is killed) still says how far it got.
`tests/test_mpi.py` launches this once per module and asserts on the files.
"""

from __future__ import annotations

import datetime
import os
import sys

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "support"))

import compcomm  # noqa: E402
from compcomm.backends.mpi import MPIBackend  # noqa: E402
from compcomm.backends.mpi_runtime import import_mpi  # noqa: E402
from compcomm.launch import free_port  # noqa: E402
from compcomm.layout import chunk_size, padded_size  # noqa: E402

from rank_checks import DTYPES, TOLERANCE, CheckFailed, digest, expect, make_input, raw, run_checks  # noqa: E402
from reference import assert_close, reference_allreduce  # noqa: E402

MPI = import_mpi()
WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()


def init_gloo() -> None:
    port = WORLD.bcast(free_port() if RANK == 0 else None, root=0)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=RANK, world_size=SIZE, timeout=datetime.timedelta(seconds=60))


# -- (1) reference and gloo parity ---------------------------------------------------------


def check_reference_and_parity() -> dict:
    """MPI against the float64 reference, and MPI vs gloo bit for bit (outputs and errors)."""
    mpi, gloo = compcomm.backends.get("mpi"), compcomm.backends.get("gloo")
    configs = [(numel, dtype, op) for numel in (1, 7, 1001, 4099) for dtype in DTYPES for op in ("mean", "sum")]
    configs.append((5_000_001, "float32", "mean"))  # wide rows: from step 1 on, gloo sends them as it scans
    configs.append((1001, "float32", "sum"))  # its first step after a wide call: phase 0 in halves, scanned whole
    steps, compared = 3, 0
    for numel, dtype, op in configs:
        ef_mpi, ef_gloo = compcomm.ErrorFeedback(), compcomm.ErrorFeedback()
        m = padded_size(numel, SIZE)
        worker, server = np.zeros((SIZE, m)), np.zeros((SIZE, m // SIZE))
        for step in range(steps):
            x = make_input(RANK, step, numel, dtype)
            a, b = x.clone(), x.clone()
            compcomm.compressed_allreduce(a, ef_mpi, backend=mpi, op=op)
            # the string name resolves to a cached gloo backend: both spellings side by side
            compcomm.compressed_allreduce(b, ef_gloo, backend=gloo if step % 2 else "gloo", op=op)
            where = f"numel={numel} {dtype} {op} step {step}"
            expect(raw(a) == raw(b), f"{where}: mpi and gloo outputs differ")
            expect(raw(ef_mpi.worker_error) == raw(ef_gloo.worker_error), f"{where}: worker errors differ")
            expect(raw(ef_mpi.server_error) == raw(ef_gloo.server_error), f"{where}: server errors differ")
            digests = WORLD.allgather(digest(a))
            expect(len(set(digests)) == 1, f"{where}: outputs differ between ranks")
            got_worker = WORLD.gather(ef_mpi.worker_error.double().numpy(), root=0)
            got_server = WORLD.gather(ef_mpi.server_error.double().numpy(), root=0)
            verdict = None
            if RANK == 0:  # the float64 reference once, not on every rank: the outputs are equal (above)
                try:
                    worker, server = compare_with_reference(a, got_worker, got_server, worker, server, step, op)
                except AssertionError as exc:
                    verdict = str(exc)
            verdict = WORLD.bcast(verdict, root=0)  # every rank fails alike, leaving none mid-collective
            expect(verdict is None, f"{where}: {verdict}")
            compared += 1
    # a non-contiguous 2-D input goes the same way on both
    ef_mpi, ef_gloo = compcomm.ErrorFeedback(), compcomm.ErrorFeedback()
    for step in range(2):
        base = make_input(RANK, step, 15 * 9, "float32", seed=3).view(15, 9)
        a, b = base.clone().t(), base.clone().t()
        compcomm.compressed_allreduce(a, ef_mpi, backend="mpi")
        compcomm.compressed_allreduce(b, ef_gloo, backend="gloo")
        expect(
            raw(a) == raw(b) and raw(ef_mpi.worker_error) == raw(ef_gloo.worker_error),
            "non-contiguous input: mpi and gloo differ",
        )
    return {"compared_steps": compared, "configs": len(configs)}


def compare_with_reference(
    out: torch.Tensor,
    got_worker: list[np.ndarray],
    got_server: list[np.ndarray],
    worker: np.ndarray,
    server: np.ndarray,
    step: int,
    op: str,
) -> tuple[np.ndarray, np.ndarray]:
    """AssertionError unless the output and every rank's errors are the float64 reference's for
    this step (of `make_input`'s inputs); returns the reference's errors for the next step."""
    numel, dtype = out.numel(), str(out.dtype).removeprefix("torch.")
    inputs = [make_input(r, step, numel, dtype).double().numpy() for r in range(SIZE)]
    expected, ref_worker, ref_server = reference_allreduce(inputs, worker, server, op)
    scale = float(np.abs(expected).max())
    tol = TOLERANCE[dtype]
    assert_close(out.double().numpy(), expected, rtol=tol, atol=tol * scale, err_msg="output")
    got_w, got_s = np.stack(got_worker), np.stack(got_server)
    assert_close(got_w, ref_worker, rtol=1e-5, atol=1e-5 * scale, err_msg="worker error vs reference")
    assert_close(got_s, ref_server, rtol=1e-5, atol=1e-5 * scale, err_msg="server error vs reference")
    return got_w, got_s


# -- (2) COMM_WORLD split into two groups ----------------------------------------------------


def check_split() -> dict:
    color = RANK // 2
    sub = WORLD.Split(color, key=RANK)
    be = MPIBackend(comm=sub)
    expect(be.world_size == 2 and be.rank == RANK % 2, f"sub-communicator rank/size {be.rank}/{be.world_size}")
    numel, ef = 1003, compcomm.ErrorFeedback()
    members = [2 * color, 2 * color + 1]
    worker, server = np.zeros((2, padded_size(numel, 2))), np.zeros((2, chunk_size(numel, 2)))
    outputs = []
    for step in range(3):
        t = make_input(RANK, step, numel, "float32", seed=11)
        compcomm.compressed_allreduce(t, ef, backend=be)
        inputs = [make_input(r, step, numel, "float32", seed=11).double().numpy() for r in members]
        expected, worker, server = reference_allreduce(inputs, worker, server, "mean")
        assert_close(
            t.double().numpy(),
            expected,
            rtol=1e-5,
            atol=1e-5 * np.abs(expected).max(),
            err_msg=f"group {color} step {step}",
        )
        got = np.stack(sub.allgather(ef.worker_error.double().numpy()))
        assert_close(got, worker, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
        worker = got
        server = np.stack(sub.allgather(ef.server_error.double().numpy()))
        outputs.append(digest(t))
    per_rank = WORLD.allgather(outputs[-1])
    expect(per_rank[0] == per_rank[1] and per_rank[2] == per_rank[3], "ranks of one group differ")
    expect(per_rank[0] != per_rank[2], "the two groups gave the same result: not reduced separately")
    t = make_input(RANK, 3, numel, "float32", seed=11)
    if RANK % 2:
        t[0] = float("nan")
    try:
        compcomm.compressed_allreduce(t, compcomm.ErrorFeedback(), backend=be)
        named = ""
    except compcomm.NonFiniteError as exc:
        named = str(exc)
    world = f" (world rank(s) [{2 * color + 1}])" if color else ""  # group 0's ranks are the world's
    expect(f"of rank(s) [1]{world};" in named, f"the refusal names the ranks: {named!r}")
    sub.Free()
    return {"group": color, "sub_rank": RANK % 2}


# -- (3) MPI sub-communicator beside a torch sub-group -------------------------------------


def check_subgroup_parity() -> dict:
    members = [1, 3]
    torch_group = dist.new_group(members, backend="gloo")  # every rank must call new_group
    sub = WORLD.Split(0 if RANK in members else MPI.UNDEFINED, key=RANK)
    if RANK not in members:
        expect(sub == MPI.COMM_NULL, "non-member did not get COMM_NULL")
        try:
            MPIBackend(comm=sub)
        except ValueError as exc:
            expect("not a member" in str(exc), f"unclear COMM_NULL error: {exc}")
        else:
            raise CheckFailed("MPIBackend(comm=COMM_NULL) did not raise")
        return {"member": False}
    mpi = compcomm.backends.get("mpi", comm=sub)
    gloo = compcomm.backends.get("gloo", group=torch_group)
    expect((mpi.rank, mpi.world_size) == (gloo.rank, gloo.world_size), "sub-group ranks disagree")
    for numel, dtype in ((5, "float32"), (999, "float16"), (2048, "bfloat16")):
        ef_mpi, ef_gloo = compcomm.ErrorFeedback(), compcomm.ErrorFeedback()
        for step in range(3):
            x = make_input(RANK, step, numel, dtype, seed=5)
            a, b = x.clone(), x.clone()
            compcomm.compressed_allreduce(a, ef_mpi, backend=mpi, op="sum")
            compcomm.compressed_allreduce(b, ef_gloo, backend=gloo, op="sum")
            expect(raw(a) == raw(b), f"sub-group numel={numel} {dtype} step {step}: outputs differ")
            expect(
                raw(ef_mpi.worker_error) == raw(ef_gloo.worker_error)
                and raw(ef_mpi.server_error) == raw(ef_gloo.server_error),
                f"sub-group numel={numel} {dtype} step {step}: error buffers differ",
            )
    sub.Free()
    return {"member": True}


# -- (4) bad input -----------------------------------------------------------------------


def _outcome(fn) -> list:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the class is what is checked
        return [type(exc).__name__, str(exc)]
    return [None, ""]


def check_bad_input() -> dict:
    """One bad rank makes every rank raise the same error, changes nothing; the next call works."""
    outcomes = {}
    for name in ("mpi", "gloo"):
        be = compcomm.backends.get(name)
        ef, numel = compcomm.ErrorFeedback(), 777
        t = make_input(RANK, 0, numel, "float32", seed=9)
        compcomm.compressed_allreduce(t, ef, backend=be)
        snapshot = (raw(t), raw(ef.worker_error), raw(ef.server_error))

        bad = t.clone()
        if RANK == 2:
            bad[100] = float("nan")
        before = raw(bad)
        outcomes[f"{name}_nan"] = _outcome(lambda: compcomm.compressed_allreduce(bad, ef, backend=be))
        expect(raw(bad) == before, f"{name}: NaN call modified the tensor")

        short = torch.zeros(numel + (1 if RANK == 3 else 0))
        outcomes[f"{name}_size"] = _outcome(lambda: compcomm.compressed_allreduce(short, ef, backend=be))
        expect(not short.any(), f"{name}: size-mismatch call modified the tensor")

        wrong = t.clone() if RANK != 1 else torch.ones(numel, dtype=torch.int32)
        outcomes[f"{name}_type"] = _outcome(lambda: compcomm.compressed_allreduce(wrong, ef, backend=be))

        expect(
            (raw(t), raw(ef.worker_error), raw(ef.server_error)) == snapshot,
            f"{name}: a rejected call changed the tensor or the error state",
        )
        nxt = make_input(RANK, 1, numel, "float32", seed=9)
        compcomm.compressed_allreduce(nxt, ef, backend=be)
        outcomes[f"{name}_next"] = digest(nxt, ef.worker_error, ef.server_error)
    everyone = WORLD.allgather({k: v[0] if isinstance(v, list) else None for k, v in outcomes.items()})
    for key in ("nan", "size", "type"):
        classes = {o[f"mpi_{key}"] for o in everyone} | {o[f"gloo_{key}"] for o in everyone}
        expect(len(classes) == 1, f"{key}: ranks/backends raised different things: {classes}")
    expect(outcomes["mpi_next"] == outcomes["gloo_next"], "after the rejected calls mpi and gloo differ")
    return {
        "raised": {k: v[0] for k, v in outcomes.items() if isinstance(v, list)},
        "messages": {k: v[1] for k, v in outcomes.items() if isinstance(v, list)},
    }


# -- (5) zero copy ---------------------------------------------------------------------


class SpyMPIBackend(MPIBackend):
    """The real backend, recording the address of every buffer it hands to MPI."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.handed: list[tuple[int, int]] = []  # (tensor data_ptr, address MPI receives)

    def buffer(self, tensor, datatype=None):
        spec = super().buffer(tensor, datatype)
        self.handed.append((tensor.data_ptr(), MPI.Get_address(spec[0])))
        return spec


def check_zero_copy() -> dict:
    be = SpyMPIBackend()
    t = make_input(RANK, 0, 4000, "float32")
    compcomm.compressed_allreduce(t, compcomm.ErrorFeedback(), backend=be)
    in_allreduce = len(be.handed)
    send = torch.arange(8, dtype=torch.uint8) + RANK
    recv = torch.empty(SIZE, 8, dtype=torch.uint8)
    be.all_gather(send, recv)
    expect(
        be.handed[-2:] == [(send.data_ptr(),) * 2, (recv.data_ptr(),) * 2],
        "all_gather did not hand the tensors' own memory to MPI",
    )
    f = torch.full((1000,), float(RANK + 1))
    ptr = f.data_ptr()
    be.all_reduce(f)
    expect(be.handed[-1] == (ptr, ptr), "all_reduce did not hand the tensor's own memory to MPI")
    expect(f.data_ptr() == ptr and bool((f == SIZE * (SIZE + 1) / 2).all()), "all_reduce result wrong")
    mismatched = [(a, b) for a, b in be.handed if a != b]
    expect(not mismatched, f"{len(mismatched)} buffers handed to MPI were copies")
    expect(be.staging.allocated == 0, "CPU tensors went through staging buffers")
    return {"buffers": len(be.handed), "in_allreduce": in_allreduce}


# -- (6) bytes_sent ----------------------------------------------------------------------


def check_bytes_sent() -> dict:
    counts = {}
    for name in ("mpi", "gloo"):
        be = compcomm.backends.get(name)
        for numel, dtype in ((1000, "float32"), (7, "float16")):

            def call(numel=numel, dtype=dtype) -> None:
                compcomm.compressed_allreduce(make_input(RANK, 0, numel, dtype), compcomm.ErrorFeedback(), backend=be)

            call()  # the same call again: phase 0 then has room for all its signs (see FOLD_BYTES)
            counts[f"{name}_compressed_{numel}"] = _sent(be, call)
        counts[f"{name}_allreduce_fp32_1000"] = _sent(be, lambda: be.all_reduce(torch.ones(1000)))
        counts[f"{name}_allreduce_bf16_1000"] = _sent(be, lambda: be.all_reduce(torch.ones(1000, dtype=torch.bfloat16)))
    return {"counts": counts, "world_size": SIZE}


def _sent(be, fn) -> int:
    start = be.bytes_sent
    fn()
    return be.bytes_sent - start


# -- async collectives and the uncompressed all-reduce -------------------------------------


def check_async_and_all_reduce() -> dict:
    be = compcomm.backends.get("mpi")
    send = torch.full((5,), RANK, dtype=torch.uint8)
    recv = torch.zeros(SIZE, 5, dtype=torch.uint8)
    handle = be.all_gather(send, recv, async_op=True)
    handle.wait()
    handle.wait()  # a second wait is harmless
    expect(bool((recv == torch.arange(SIZE, dtype=torch.uint8)[:, None]).all()), "async all_gather wrong")
    send2 = (torch.arange(SIZE * 3, dtype=torch.uint8).view(SIZE, 3) + 10 * RANK).contiguous()
    recv2 = torch.zeros(SIZE, 3, dtype=torch.uint8)
    be.all_to_all(send2, recv2, async_op=True).wait()
    want = torch.stack([torch.arange(RANK * 3, RANK * 3 + 3, dtype=torch.uint8) + 10 * r for r in range(SIZE)])
    expect(torch.equal(recv2, want), "async all_to_all wrong")
    sums = {}
    for dtype in ("float32", "float16", "bfloat16"):
        x = torch.full((33,), float(RANK + 1), dtype=DTYPES[dtype])
        be.all_reduce(x, op="sum")
        y = torch.full((33,), float(RANK + 1), dtype=DTYPES[dtype])
        be.all_reduce(y, op="mean")
        expect(x.dtype == DTYPES[dtype] and bool((x == SIZE * (SIZE + 1) / 2).all()), f"{dtype} sum wrong")
        expect(bool((y == (SIZE + 1) / 2).all()), f"{dtype} mean wrong")
        sums[dtype] = float(x[0])
    w = torch.full((4,), float(RANK + 1), requires_grad=True)  # a parameter: its data is reduced
    be.all_reduce(w, op="mean")
    expect(bool((w.detach() == (SIZE + 1) / 2).all()) and w.grad_fn is None, "all_reduce of a parameter wrong")
    ints = torch.arange(3) + RANK
    try:
        be.all_reduce(ints, op="mean")
        expect(False, "mean of an integer tensor accepted")
    except TypeError:
        expect(torch.equal(ints, torch.arange(3) + RANK), "a refused all_reduce changed the tensor")
    be.barrier()
    return {"sums": sums}


CHECKS = [
    check_reference_and_parity,
    check_split,
    check_subgroup_parity,
    check_bad_input,
    check_zero_copy,
    check_bytes_sent,
    check_async_and_all_reduce,
]


def main(out_dir: str) -> int:
    torch.set_num_threads(1)
    # before torch.distributed exists, backend=None under mpirun picks MPI
    auto = compcomm.backends.resolve(None, torch.zeros(1)).name
    init_gloo()
    run_checks(
        {check.__name__[len("check_") :]: check for check in CHECKS},
        os.path.join(out_dir, f"rank{RANK}.json"),
        {"world_size": SIZE, "rank": RANK, "auto_backend": auto},
        WORLD.Barrier,
    )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "."))

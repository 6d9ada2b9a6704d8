"""GPU checks of the nccl and mpi backends; `tests/test_nccl.py` runs them where CUDA exists.

    python tests/programs/cuda_checks.py nccl OUT_DIR        spawns 2 NCCL ranks (1 if only one GPU)
    mpirun -n 2 python tests/programs/cuda_checks.py mpi OUT_DIR

Each rank writes OUT_DIR/<mode>_rank<r>.json: {check: {"ok", "detail", ...}}. The same inputs go
through the GPU path and through gloo/MPI on CPU tensors, and must give the same bits.
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
from compcomm.launch import spawn  # noqa: E402
from compcomm.layout import padded_size  # noqa: E402

from rank_checks import DTYPES, TOLERANCE, expect, make_input, raw, run_checks  # noqa: E402
from reference import reference_allreduce  # noqa: E402

CONFIGS = [(numel, dtype, op) for numel in (7, 1001, 70001) for dtype in DTYPES for op in ("mean", "sum")]


def parity(gpu_backend, cpu_backend, rank: int, world: int, gather) -> int:
    """GPU tensors on `gpu_backend` vs CPU tensors on `cpu_backend`: same bits, and the reference."""
    device = torch.device("cuda", torch.cuda.current_device())
    steps = 0
    for numel, dtype, op in CONFIGS:
        ef_gpu, ef_cpu = compcomm.ErrorFeedback(), compcomm.ErrorFeedback()
        m = padded_size(numel, world)
        worker, server = np.zeros((world, m)), np.zeros((world, m // world))
        for step in range(3):
            x = make_input(rank, step, numel, dtype)
            g, c = x.to(device), x.clone()
            compcomm.compressed_allreduce(g, ef_gpu, backend=gpu_backend, op=op)
            compcomm.compressed_allreduce(c, ef_cpu, backend=cpu_backend, op=op)
            where = f"numel={numel} {dtype} {op} step {step}"
            expect(g.is_cuda and ef_gpu.worker_error.is_cuda, f"{where}: result left the GPU")
            expect(raw(g) == raw(c), f"{where}: GPU and CPU outputs differ")
            expect(
                raw(ef_gpu.worker_error) == raw(ef_cpu.worker_error)
                and raw(ef_gpu.server_error) == raw(ef_cpu.server_error),
                f"{where}: error buffers differ",
            )
            inputs = [make_input(r, step, numel, dtype).double().numpy() for r in range(world)]
            expected, _, _ = reference_allreduce(inputs, worker, server, op)
            tol = TOLERANCE[dtype]
            np.testing.assert_allclose(
                g.double().cpu().numpy(), expected, rtol=tol, atol=tol * float(np.abs(expected).max()), err_msg=where
            )
            worker = np.stack(gather(ef_gpu.worker_error.double().cpu().numpy()))
            server = np.stack(gather(ef_gpu.server_error.double().cpu().numpy()))
            steps += 1
    return steps


def nonfinite_everywhere(backend, rank: int, world: int) -> str:
    device = torch.device("cuda", torch.cuda.current_device())
    ef = compcomm.ErrorFeedback()
    t = make_input(rank, 0, 501, "float32").to(device)
    compcomm.compressed_allreduce(t, ef, backend=backend)
    before = (raw(t), raw(ef.worker_error), raw(ef.server_error))
    bad = t.clone()
    if rank == world - 1:
        bad[3] = float("inf")
    try:
        compcomm.compressed_allreduce(bad, ef, backend=backend)
    except compcomm.NonFiniteError:
        pass
    else:
        raise AssertionError("no NonFiniteError")
    expect((raw(t), raw(ef.worker_error), raw(ef.server_error)) == before, "rejected call changed state")
    compcomm.compressed_allreduce(t, ef, backend=backend)
    return "NonFiniteError"


# -- NCCL: spawned ranks, one GPU each ------------------------------------------------------


def nccl_rank(out_dir: str) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=120))
    cpu_group = dist.new_group(list(range(world)), backend="gloo")
    nccl = compcomm.backends.get("nccl")
    gloo = compcomm.backends.get("gloo", group=cpu_group)

    def gather(obj):
        out = [None] * world
        dist.all_gather_object(out, obj, group=cpu_group)
        return out

    def check_backend():
        expect(nccl.device == torch.device("cuda", torch.cuda.current_device()), f"device {nccl.device}")
        expect(nccl.serves(torch.device("cuda")) and not nccl.serves(torch.device("cpu")), "serves")
        auto = compcomm.backends.resolve(None, torch.zeros(1, device="cuda")).name
        expect(auto == "nccl", f"backend=None picked {auto} for a CUDA tensor")
        return {"world_size": nccl.world_size}

    def check_parity():
        return {"steps": parity(nccl, gloo, rank, world, gather)}

    def check_bytes_sent():
        counts = []
        for be, device in ((nccl, "cuda"), (gloo, "cpu")):
            start = be.bytes_sent
            compcomm.compressed_allreduce(
                make_input(rank, 0, 1000, "float32").to(device), compcomm.ErrorFeedback(), backend=be
            )
            counts.append(be.bytes_sent - start)
        expect(counts[0] == counts[1], f"nccl counted {counts[0]} bytes, gloo {counts[1]}")
        return {"compressed_1000": counts[0]}

    def check_nonfinite():
        return {"raised": nonfinite_everywhere(nccl, rank, world)}

    def check_async_on_own_device():
        """An async call runs on a worker thread, whose current CUDA device is device 0: its
        buffers must still be on this rank's GPU (on GPU 0 they paired with no peer's)."""
        device = torch.device("cuda", torch.cuda.current_device())
        inputs = [make_input(rank, 0, n, "float32").to(device) for n in (1001, 70001)]
        copies = [x.clone() for x in inputs]
        in_turn = [compcomm.ErrorFeedback() for _ in inputs]
        at_once = [compcomm.ErrorFeedback() for _ in inputs]
        compcomm.compressed_allreduce_coalesced(inputs, in_turn, backend=nccl, async_op=True).wait()
        compcomm.compressed_allreduce_coalesced(copies, at_once, backend=nccl)
        expect([raw(x) for x in inputs] == [raw(x) for x in copies], "the async call differs from the blocking one")
        expect(nccl.device == device, f"the backend's device {nccl.device} is not this rank's {device}")
        others = [d for d in range(torch.cuda.device_count()) if d != device.index]
        used = [d for d in others if torch.cuda.memory_allocated(d) > 0]
        expect(not used, f"memory allocated on other GPUs {used}")
        return {"other_gpus": len(others)}

    run_checks(
        {
            "backend": check_backend,
            "parity": check_parity,
            "bytes_sent": check_bytes_sent,
            "nonfinite": check_nonfinite,
            "async_device": check_async_on_own_device,
        },
        os.path.join(out_dir, f"nccl_rank{rank}.json"),
    )
    dist.destroy_process_group()


def main_nccl(out_dir: str) -> int:
    spawn(nccl_rank, 2 if torch.cuda.device_count() >= 2 else 1, out_dir)
    return 0


# -- MPI with CUDA tensors: staged through pinned memory, and direct when CUDA-aware -----------


def main_mpi(out_dir: str) -> int:
    from compcomm.backends.mpi import MPIBackend
    from compcomm.backends.mpi_runtime import import_mpi, query_cuda_aware

    MPI = import_mpi()
    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    torch.cuda.set_device(rank % torch.cuda.device_count())
    detected = query_cuda_aware(MPI)
    staged = MPIBackend(cuda_aware=False)
    cpu = MPIBackend()
    checks = {}

    def check_staged():
        steps = parity(staged, cpu, rank, world, comm.allgather)
        allocated = staged.staging.allocated
        expect(allocated <= 4, f"{allocated} pinned buffers for {steps} calls: staging is not reused")
        expect(all(b.is_pinned() for b in staged.staging.free), "staging buffers are not pinned")
        send = torch.full((6,), rank, dtype=torch.uint8, device="cuda")
        recv = torch.zeros(world, 6, dtype=torch.uint8, device="cuda")
        handle = staged.all_gather(send, recv, async_op=True)
        handle.wait()
        expect(
            torch.equal(recv.cpu(), torch.arange(world, dtype=torch.uint8)[:, None].expand(world, 6)),
            "staged async all_gather wrong",
        )
        x = torch.full((17,), float(rank + 1), dtype=torch.bfloat16, device="cuda")
        staged.all_reduce(x)
        expect(bool((x == world * (world + 1) / 2).all()), "staged bf16 all_reduce wrong")
        return {"steps": steps, "pinned_buffers": allocated}

    checks["staged"] = check_staged
    checks["nonfinite"] = lambda: {"raised": nonfinite_everywhere(staged, rank, world)}
    if detected:
        aware = MPIBackend(cuda_aware=True)

        def check_aware():
            t = torch.zeros(8, dtype=torch.uint8, device="cuda")
            spec = aware.buffer(t)
            expect(spec[0].__cuda_array_interface__["data"][0] == t.data_ptr(), "CUDA buffer was copied")
            steps = parity(aware, cpu, rank, world, comm.allgather)
            expect(aware.staging.allocated == 0, "CUDA-aware MPI went through staging")
            return {"steps": steps}

        checks["aware"] = check_aware
    checks["detected"] = lambda: {"cuda_aware": detected}
    run_checks(checks, os.path.join(out_dir, f"mpi_rank{rank}.json"))
    return 0


if __name__ == "__main__":
    mode, out = sys.argv[1], sys.argv[2]
    sys.exit(main_nccl(out) if mode == "nccl" else main_mpi(out))

"""The training layers (the DDP hook, the optimizers, DiLoCo, compcomm.fsdp's collective) with CUDA tensors,
against the same training with CPU tensors: `mpirun -n 2 python tests/programs/cuda_training_checks.py OUT_DIR`.

Both ranks may share one GPU, which NCCL refuses within one communicator, so compcomm's CUDA calls
go over the mpi backend (staged through pinned host memory unless MPI is CUDA-aware) and torch's
process group is gloo (HSDP of CUDA parameters needs NCCL groups: its refusal of a gloo one is
checked). Each rank writes OUT_DIR/rank<r>.json.

The gradients are set, or made by a model whose gradients are its inputs exactly, so the CPU
and the CUDA runs reduce the same bits: the DDP hook and the reduce-scatter must then give the same
results bit for bit. The optimizers' own elementwise math may round differently on the two devices (the
CUDA compiler fuses multiply-adds), so their parameters are compared to a tolerance, and bit for
bit between a run and the same run resumed from a checkpoint on the GPU.
"""

from __future__ import annotations

import datetime
import io
import os
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "support"))

import compcomm  # noqa: E402
from compcomm.backends.mpi_runtime import import_mpi  # noqa: E402
from compcomm.ddp import OnebitHookState, onebit_hook  # noqa: E402
from compcomm.launch import free_port  # noqa: E402
from compcomm.optim import DiLoCo, OnebitAdam, OnebitLamb, ZeroOneAdam  # noqa: E402

from rank_checks import CheckFailed, expect, make_input, raw, run_checks  # noqa: E402

MPI = import_mpi()
RANK, WORLD = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
DEVICE = torch.device(os.environ.get("COMPCOMM_CHECK_DEVICE", "cuda"))  # "cpu" rehearses the program without a GPU
CPU = torch.device("cpu")
SHAPES = [(33,), (8, 16), (5,), (3, 7)]
STEPS = 6
TOLERANCE = 1e-4  # relative to each parameter's largest magnitude


class ExactNet(torch.nn.Module):
    """sum_i <w_i, x_i>: the gradient of w_i is x_i exactly, on any device."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(Weight(shape, i) for i, shape in enumerate(SHAPES))

    def forward(self, xs: list[torch.Tensor]) -> torch.Tensor:
        return sum((layer(x) for layer, x in zip(self.layers, xs)), torch.zeros((), device=xs[0].device))


class Weight(torch.nn.Module):
    def __init__(self, shape: tuple[int, ...], seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w = torch.nn.Parameter(torch.randn(shape, generator=g))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.w * x).sum()


def inputs(step: int, device: torch.device) -> list[torch.Tensor]:
    """This rank's step-`step` gradients, one per parameter (the same values on every device)."""
    return [make_input(RANK, step, n, "float32", seed=i).reshape(s).to(device) for i, (s, n) in enumerate(_sizes())]


def _sizes() -> list[tuple[tuple[int, ...], int]]:
    return [(s, int(torch.Size(s).numel())) for s in SHAPES]


def relative_gap(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """The largest |a - b| over each tensor's largest |b|, in float64 on the CPU."""

    def gap(x: torch.Tensor, y: torch.Tensor) -> float:
        x, y = x.detach().double().cpu(), y.detach().double().cpu()
        return float((x - y).abs().max() / y.abs().max())

    return max(gap(x, y) for x, y in zip(a, b))


def on_device(tensors: list[torch.Tensor], what: str) -> None:
    """Every tensor of a parameter's size that `what` keeps is on DEVICE."""
    stray = [tuple(t.shape) for t in tensors if t.numel() > 1 and t.device.type != DEVICE.type]
    expect(not stray, f"{what} keeps tensors of shapes {stray} off {DEVICE}")


def state_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    for state in opt.state.values():
        found += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return found


# -- the DDP hook ----------------------------------------------------------------------------------


def hook_gradients(
    device: torch.device, group: dist.ProcessGroup, backend, steps_run: range = range(STEPS), resume: dict | None = None
) -> tuple[list[bytes], OnebitHookState]:
    """Each step's averaged gradients under DDP with onebit_hook (exact for 2 steps, then 1-bit),
    from a fresh state or from the state dict `resume`."""
    model = DDP(ExactNet().to(device), process_group=group, bucket_cap_mb=0.0005)
    state = OnebitHookState(process_group=group, start_iter=2, backend=backend)
    if resume is not None:
        state.load_state_dict(resume)
    model.register_comm_hook(state, onebit_hook)
    steps = []
    for step in steps_run:
        model.zero_grad(set_to_none=True)
        model(inputs(step, device)).backward()
        steps.append(b"".join(raw(p.grad) for p in model.parameters()))
    if device == DEVICE:
        on_device([p.grad for p in model.parameters()], "DDP")
    return steps, state


def check_ddp_hook(cuda_group: dist.ProcessGroup, cpu_group: dist.ProcessGroup) -> dict:
    on_gpu, state = hook_gradients(DEVICE, cuda_group, "mpi")
    on_cpu, _ = hook_gradients(CPU, cpu_group, "mpi")
    same = [a == b for a, b in zip(on_gpu, on_cpu)]
    expect(all(same), f"gradients differ from the CPU run's at steps {[i for i, s in enumerate(same) if not s]}")
    errors = [t for ef in state.error_feedback.values() for t in (ef.worker_error, ef.server_error)]
    on_device(errors, "the hook's error feedback")
    return {"steps": len(same), "buckets": len(state.error_feedback)}


def check_ddp_checkpoint(cuda_group: dist.ProcessGroup) -> dict:
    """The hook's gathered state dict (one file for every rank) holds CPU tensors only, and a run
    resumed from it on the GPU reduces as the uninterrupted one, bit for bit."""
    half = STEPS // 2
    first, state = hook_gradients(DEVICE, cuda_group, "mpi", range(half))
    gathered = state.gathered_state_dict()
    stray = [tuple(t.shape) for t in tensors_in(gathered) if t.device.type != "cpu"]
    expect(not stray, f"the gathered state dict holds tensors of shapes {stray} off the CPU")
    uninterrupted, _ = hook_gradients(DEVICE, cuda_group, "mpi")
    resumed, _ = hook_gradients(DEVICE, cuda_group, "mpi", range(half, STEPS), resume=gathered)
    expect(first == uninterrupted[:half], "the first steps differ between two runs")
    expect(resumed == uninterrupted[half:], "the run resumed from the gathered state dict differs")
    return {"steps": STEPS}


def tensors_in(obj: object) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in tensors_in(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in tensors_in(v)]
    return []


# -- the optimizers --------------------------------------------------------------------------------


def build(kind: str, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    if kind == "OnebitAdam":
        return OnebitAdam(params, lr=1e-2, freeze_step=2, backend="mpi")
    if kind == "OnebitLamb":
        return OnebitLamb(params, lr=1e-2, freeze_step=2, backend="mpi")
    if kind == "ZeroOneAdam":
        return ZeroOneAdam(params, lr=1e-2, var_freeze_step=2, var_update_scaler=1, local_step_scaler=2, backend="mpi")
    inner = torch.optim.SGD(params, lr=0.1)
    return DiLoCo(params, inner, sync_every=2, backend="mpi")


def train(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter], steps: range) -> None:
    for step in steps:
        for p, g in zip(params, inputs(step, params[0].device)):
            p.grad = g
        opt.step()


def fresh(device: torch.device) -> list[torch.nn.Parameter]:
    return [p.detach().to(device).requires_grad_() for p in ExactNet().parameters()]


def check_optimizer(kind: str) -> dict:
    gpu, cpu = fresh(DEVICE), fresh(CPU)
    opt_gpu, opt_cpu = build(kind, gpu), build(kind, cpu)
    half = STEPS // 2
    train(opt_gpu, gpu, range(half))
    train(opt_cpu, cpu, range(half))
    buffer = io.BytesIO()
    torch.save(opt_gpu.state_dict(), buffer)
    resumed = fresh(DEVICE)  # as a resumed job: built afresh, then the saved parameters and state loaded
    opt_resumed = build(kind, resumed)
    with torch.no_grad():
        for p, saved in zip(resumed, gpu):
            p.copy_(saved)
    buffer.seek(0)
    opt_resumed.load_state_dict(torch.load(buffer, weights_only=False))
    for opt, params in ((opt_gpu, gpu), (opt_cpu, cpu), (opt_resumed, resumed)):
        train(opt, params, range(half, STEPS))
    gap = relative_gap(gpu, cpu)
    expect(gap <= TOLERANCE, f"parameters {gap:.2e} (relative) from the CPU run's")
    expect([raw(p) for p in resumed] == [raw(p) for p in gpu], "the run resumed from a checkpoint differs")
    on_device(state_tensors(opt_gpu), kind)
    expect(all(p.device.type == DEVICE.type for p in gpu), "parameters left the device")
    return {"relative_gap": gap, "steps": STEPS}


# -- compcomm.fsdp: its reduce-scatter, and HSDP's need for NCCL groups -----------------------------


def check_reduce_scatter() -> dict:
    """compcomm.fsdp's FSDP-mode collective, the 1-bit reduce-scatter, on CUDA tensors against CPU
    ones: the same shards and worker errors, bit for bit (FSDP2 itself shards CUDA parameters over
    NCCL, which needs a GPU per rank)."""
    errors = [compcomm.ErrorFeedback(), compcomm.ErrorFeedback()]  # on DEVICE, on the CPU
    for step in range(STEPS):
        results = []
        for device, ef in zip((DEVICE, CPU), errors):
            x = make_input(RANK, step, WORLD * 1001, "float32").to(device)
            out = torch.empty(1001, device=device)
            compcomm.compressed_reduce_scatter(out, x, ef, backend="mpi")
            results.append(raw(out) + raw(ef.worker_error))
        expect(results[0] == results[1], f"step {step}: the shard or the worker error differs from the CPU's")
    on_device([errors[0].worker_error], "the reduce-scatter's error feedback")
    return {"steps": STEPS}


def sharded(device: torch.device, shard_group: dist.ProcessGroup) -> torch.nn.Module:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    model = ExactNet().to(device)
    mesh = DeviceMesh.from_group(shard_group, device.type)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def check_hsdp_needs_nccl(shard_group: dist.ProcessGroup, replicas: dist.ProcessGroup) -> dict:
    """HSDP with CUDA parameters agrees over NCCL on the model's groups, whatever backend= is: a
    gloo replicate group is refused on every rank, naming the fix."""
    try:
        compcomm.fsdp.compress(sharded(DEVICE, shard_group), replicate_group=replicas, backend="mpi")
    except RuntimeError as exc:
        expect("needs a process group with nccl" in str(exc), f"another error: {exc}")
        return {"refused": str(exc)}
    raise CheckFailed("compress took a gloo replicate group for CUDA parameters")


# -- the program -----------------------------------------------------------------------------------


def one_rank_groups(backend: str) -> dist.ProcessGroup:
    """This rank's own one-rank group (every rank takes part in making every group)."""
    groups = [dist.new_group([r], backend=backend) for r in range(WORLD)]
    return groups[RANK]


def main(out: str) -> None:
    if DEVICE.type == "cuda":
        torch.cuda.set_device(RANK % torch.cuda.device_count())
    port = MPI.COMM_WORLD.bcast(free_port() if RANK == 0 else None, root=0)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=RANK, world_size=WORLD,
        timeout=datetime.timedelta(seconds=120),
    )  # fmt: skip
    cpu_group = dist.new_group(list(range(WORLD)), backend="gloo")
    checks: dict[str, Callable[[], dict | None]] = {
        "ddp_hook": lambda: check_ddp_hook(dist.group.WORLD, cpu_group),
        "ddp_checkpoint": lambda: check_ddp_checkpoint(dist.group.WORLD),
        **{kind: (lambda kind=kind: check_optimizer(kind)) for kind in ("OnebitAdam", "OnebitLamb", "ZeroOneAdam")},
        "DiLoCo": lambda: check_optimizer("DiLoCo"),
        "reduce_scatter": check_reduce_scatter,
    }
    if DEVICE.type == "cuda":
        own = one_rank_groups("nccl")
        checks["hsdp_needs_nccl"] = lambda: check_hsdp_needs_nccl(own, dist.group.WORLD)
    run_checks(
        checks,
        os.path.join(out, f"rank{RANK}.json"),
        {"device": str(DEVICE), "world": WORLD},
        between=lambda: MPI.COMM_WORLD.Barrier(),
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])

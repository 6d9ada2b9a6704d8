"""GPU paths: the nccl backend, the mpi backend with CUDA tensors (staged, and direct when MPI is
CUDA-aware), and the training layers on CUDA (the DDP hook, the optimizers, DiLoCo, the
reduce-scatter of compcomm.fsdp), each against the CPU path. Skipped where CUDA is missing.

NCCL runs 2 spawned ranks on 2 GPUs (world size 1 on a single GPU); MPI runs `mpirun -n 2`
(both ranks may share one GPU). One launch each for the whole module.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from launched import launch, mpirun_python, passed

PROGRAMS = Path(__file__).resolve().parent / "programs"
TIMEOUT_S = 300

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="no CUDA device (torch.cuda.is_available() is False): the NCCL and CUDA-MPI checks need a GPU",
    ),
]


@pytest.fixture(scope="module")
def nccl_ranks(tmp_path_factory) -> list[dict]:
    if not (torch.distributed.is_available() and torch.distributed.is_nccl_available()):
        pytest.skip("this torch build has no NCCL")
    out = tmp_path_factory.mktemp("nccl")
    world = 2 if torch.cuda.device_count() >= 2 else 1
    return launch([sys.executable, str(PROGRAMS / "cuda_checks.py"), "nccl", str(out)], out, "nccl_", world, TIMEOUT_S)


@pytest.fixture(scope="module")
def mpi_ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("cuda_mpi")
    return launch(mpirun_python(2) + [str(PROGRAMS / "cuda_checks.py"), "mpi", str(out)], out, "mpi_", 2, TIMEOUT_S)


@pytest.fixture(scope="module")
def training_ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("cuda_training")
    cmd = mpirun_python(2) + [str(PROGRAMS / "cuda_training_checks.py"), str(out)]
    return launch(cmd, out, "", 2, TIMEOUT_S)


def test_nccl_backend_on_current_device(nccl_ranks):
    assert [r["world_size"] for r in passed(nccl_ranks, "backend")] == [len(nccl_ranks)] * len(nccl_ranks)


def test_nccl_matches_gloo_bitwise(nccl_ranks):
    assert all(r["steps"] == 54 for r in passed(nccl_ranks, "parity"))


def test_nccl_bytes_sent_like_gloo(nccl_ranks):
    passed(nccl_ranks, "bytes_sent")


def test_nccl_nonfinite_everywhere(nccl_ranks):
    assert all(r["raised"] == "NonFiniteError" for r in passed(nccl_ranks, "nonfinite"))


def test_nccl_async_calls_stay_on_each_ranks_own_gpu(nccl_ranks):
    passed(nccl_ranks, "async_device")


@pytest.mark.mpi
def test_mpi_cuda_staged_through_reused_pinned_buffers(mpi_ranks):
    for r in passed(mpi_ranks, "staged"):
        assert r["steps"] == 54 and r["pinned_buffers"] <= 4


@pytest.mark.mpi
def test_mpi_cuda_nonfinite_everywhere(mpi_ranks):
    assert all(r["raised"] == "NonFiniteError" for r in passed(mpi_ranks, "nonfinite"))


@pytest.mark.mpi
def test_mpi_cuda_aware_direct(mpi_ranks):
    if not mpi_ranks[0]["detected"]["cuda_aware"]:
        pytest.skip("this MPI does not report CUDA-awareness (MPIX_Query_cuda_support is 0 or absent)")
    assert all(r["steps"] == 54 for r in passed(mpi_ranks, "aware"))


@pytest.mark.mpi
def test_ddp_hook_on_cuda_gives_the_cpu_gradients_bitwise(training_ranks):
    for r in passed(training_ranks, "ddp_hook"):
        assert r["steps"] == 6 and r["buckets"] >= 2


@pytest.mark.mpi
def test_ddp_hook_resumes_on_cuda_from_a_gathered_state_dict_of_cpu_tensors(training_ranks):
    assert all(r["steps"] == 6 for r in passed(training_ranks, "ddp_checkpoint"))


@pytest.mark.mpi
@pytest.mark.parametrize("kind", ["OnebitAdam", "OnebitLamb", "ZeroOneAdam", "DiLoCo"])
def test_optimizer_on_cuda_follows_the_cpu_run_and_resumes_bitwise(training_ranks, kind):
    assert all(r["relative_gap"] <= 1e-4 for r in passed(training_ranks, kind))


@pytest.mark.mpi
def test_reduce_scatter_on_cuda_gives_the_cpu_shards_bitwise(training_ranks):
    assert all(r["steps"] == 6 for r in passed(training_ranks, "reduce_scatter"))


@pytest.mark.mpi
def test_hsdp_of_cuda_parameters_over_a_gloo_replicate_group_is_refused_naming_nccl(training_ranks):
    passed(training_ranks, "hsdp_needs_nccl")

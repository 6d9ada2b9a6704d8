"""The transport interface: a backend moves bytes and counts them, it never decides numerics."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable
from typing import Any, Protocol

import torch

from . import ordering

REDUCE_OPS = ("sum", "mean")
ALL_REDUCE_DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int8,
    torch.uint8,
)
"""What `all_reduce` sums, on every backend alike: the dtypes that gloo, NCCL, MPI and shm all
add (gloo has no int16; none of them sums bool or complex the same way)."""
AGREED = "compcomm_agreed"
"""The attribute (True) of an error that every rank of a call raised alike, as agreed (the ranks
are in step after it): any other error out of a call may have left them out of step."""

Task = Callable[[], None]
"""Work a caller runs while a collective is on the wire."""
OnRow = Callable[[int], None]
"""What a caller does with row j of an all-gather once it is in (`Backend.all_gather_arriving`)."""


class Handle(Protocol):
    """A collective in flight: `wait()` returns once its receive buffer is filled."""

    def wait(self) -> object: ...


class Done:
    """The handle of a collective that has already completed."""

    def wait(self) -> None:
        return None


class Backend(ABC):
    """Collectives over one group of ranks, on uint8 buffers of this backend's `device`.

    `bytes_sent` counts the payload bytes this rank handed to the transport for its peers
    (its own block excluded): (n-1) * L for an all-gather or all-to-all of L-byte blocks, and
    2 (n-1)/n * size for an uncompressed ring all-reduce. Subclasses implement the `_`-methods.

    Every collective runs on this group's `channel` (see `compcomm.backends.ordering`): a private
    duplicate of the group, opened at the first collective, in one order per group shared by
    every backend object over it. So the caller's own collectives on the group, and compcomm
    calls still in flight, never pair with the wrong messages. The `_`-methods send on
    `self.transport`, the private duplicate.

    The byte collectives trust their sizes, as torch's and MPI's do: every rank must pass the
    same (shm checks and raises ValueError on every rank; gloo aborts the process; MPI may fail
    on some ranks only). compcomm's own calls never rely on that: their agreement sizes every
    exchange alike on every rank, whatever the arguments.
    """

    name = "backend"

    def __init__(self) -> None:
        self.bytes_sent = 0

    # -- ordering --------------------------------------------------------------------------

    @abstractmethod
    def _channel_key(self) -> Hashable:
        """What identifies the underlying group: equal for every backend object over it."""

    @abstractmethod
    def _open_transport(self) -> Any:
        """Make the private duplicate of the group (a collective over its members, made once)."""

    @property
    def channel(self) -> ordering.Channel:
        """The ordered lane of this group's compcomm collectives (opened on first use)."""
        return ordering.channel(self._channel_key(), self._open_transport)

    @property
    def channels(self) -> list[ordering.Channel]:
        """Every channel a call on this backend uses (a composite backend has several)."""
        return [self.channel]

    def sequence_number(self) -> int:
        """The number of the call running now on this backend, equal on every rank that makes
        the same calls (phase 0 compares it to catch ranks out of step)."""
        return ordering.sequence_number(self.channel)

    @property
    def transport(self) -> Any:
        return self.channel.transport

    def ordered(self, fn: Callable, *args, async_op: bool = False) -> Any:
        """fn(*args) in its turn on this backend's channels; async_op returns a handle at once.
        RuntimeError for a backend whose group is gone (`check_current`)."""
        self.check_current()
        if async_op:
            return ordering.submit(self.channels, self._on_device(fn), *args)
        return ordering.run(self.channels, fn, *args)

    def _on_device(self, fn: Callable) -> Callable:
        """`fn` run with this backend's CUDA device current: async calls run on a worker thread,
        whose current device is device 0 whatever the caller set (it is per thread), so on any
        other GPU the kernels and buffers made for "cuda" would land on GPU 0."""
        device = self.device
        if device.type != "cuda":
            return fn

        def on_device(*args: Any) -> Any:
            with torch.cuda.device(device):
                return fn(*args)

        return on_device

    def check_current(self) -> None:
        """RuntimeError when this backend's group was made under a default process group that
        has since been destroyed (`torch.distributed.destroy_process_group`): it cannot follow
        the new one, and its calls would pair with nobody or with the wrong ranks. Nothing to
        check for a backend that depends on no such group."""
        return None

    def abandon(self, reason: str) -> None:
        """This rank leaves a call of this group out of step with its peers (a composite call
        whose other group failed under it): the group's channel is broken, so that its later
        calls raise at once instead of pairing with the peers' pending ones, and a transport
        that can tell the waiting peers (shm) does."""
        ordering.break_channel(self._channel_key(), reason)

    def _break_channel(self, reason: str) -> RuntimeError:
        """Mark this group's channel unusable after a failure that leaves the peers out of step (a
        timed-out collective), so that every backend object over the group refuses calls; returns
        the error to raise. By key: the channel may be failing to open."""
        ordering.break_channel(self._channel_key(), reason)
        return RuntimeError(reason)

    @property
    @abstractmethod
    def rank(self) -> int:
        """This process's rank in the backend's group."""

    @property
    @abstractmethod
    def world_size(self) -> int:
        """The number of ranks in the backend's group."""

    @property
    @abstractmethod
    def device(self) -> torch.device:
        """The device whose buffers the collectives take (cpu, or this rank's CUDA device)."""

    def world_ranks(self) -> list[int] | None:
        """The members' ranks in the launch's whole world (torch's default group, MPI's
        COMM_WORLD), in this group's order, for messages that name ranks; None where they are
        this group's own (the whole world, a group of its first ranks, one process)."""
        return None

    def serves(self, device: torch.device) -> bool:
        """Whether tensors on `device` can go through this backend."""
        return device.type == self.device.type

    def all_gather(self, send: torch.Tensor, recv: torch.Tensor, async_op: bool = False) -> Handle:
        """recv[r] <- rank r's `send`, for `send` of shape (L,) and `recv` of shape (n, L).

        With async_op=True it may return before completion; `recv` is valid after `wait()`.
        """
        self._count_gather(send, recv)
        return self._in_turn(self._all_gather, send, recv, async_op)

    def all_gather_arriving(self, send: torch.Tensor, recv: torch.Tensor, meanwhile: Task, arrived: OnRow) -> None:
        """The all-gather of `all_gather`, running `meanwhile()` once it is on the wire and
        `arrived(j)` for every other rank's row j once that row is in `recv` (each once, in some
        order), so that the caller works on the rows that are in while the rest travel. Only
        inside a running compcomm call (which holds the channels). Here every row arrives at the
        end; a transport that receives row by row overrides `_all_gather_arriving`."""
        if not self._in_call():
            raise RuntimeError("all_gather_arriving runs inside a compcomm call (in its turn on the channels)")
        self._count_gather(send, recv)
        self._all_gather_arriving(send, recv, meanwhile, arrived)

    def _count_gather(self, send: torch.Tensor, recv: torch.Tensor) -> None:
        """An all-gather's checks (ValueError) and its bytes, counted."""
        self._check_bytes(send, recv)
        if recv.shape != (self.world_size, send.numel()):
            raise ValueError(f"all_gather: recv shape {tuple(recv.shape)} != ({self.world_size}, {send.numel()})")
        self.bytes_sent += (self.world_size - 1) * send.numel()

    def _all_gather_arriving(self, send: torch.Tensor, recv: torch.Tensor, meanwhile: Task, arrived: OnRow) -> None:
        handle = self._all_gather(send, recv, True)
        meanwhile()
        if handle is not None:
            handle.wait()
        for j in range(self.world_size):
            if j != self.rank:
                arrived(j)

    def all_to_all(self, send: torch.Tensor, recv: torch.Tensor, async_op: bool = False) -> Handle:
        """recv[r] <- rank r's send[self.rank], for `send` and `recv` of shape (n, L) (async as all_gather)."""
        self._count_all_to_all(send, recv)
        return self._in_turn(self._all_to_all, send, recv, async_op)

    def all_to_all_as_produced(self, send: torch.Tensor, recv: torch.Tensor, produce: OnRow, meanwhile: Task) -> None:
        """The all-to-all of `all_to_all`, whose rows the caller fills as the transport asks:
        `produce(j)` writes send[j], once for every j (this rank's own row too), in an order the
        transport picks, and a transport that sends row by row sends row j as soon as it is
        written, so that producing the next rows overlaps the wire. `meanwhile()` runs once every
        row is produced, while rows may still travel. Only inside a running compcomm call.

        An exception from `produce` or `meanwhile` is raised after every row has been sent and
        received (the rows it did not write travel as they are), so that no peer is left
        waiting. Here every row is produced first and one all-to-all sends them; a transport
        that sends row by row overrides `_all_to_all_as_produced`."""
        if not self._in_call():
            raise RuntimeError("all_to_all_as_produced runs inside a compcomm call (in its turn on the channels)")
        self._count_all_to_all(send, recv)
        failure = _Failure()
        self._all_to_all_as_produced(send, recv, failure.guard(produce), failure.guard(meanwhile))
        failure.raise_first()

    def sends_row_by_row(self, width: int) -> bool:
        """Whether `all_to_all_as_produced` sends rows of `width` bytes one by one, as they are
        produced: only then does a schedule gain by producing its rows as it goes. Depends on
        nothing but the group and `width`, so it is the same on every rank."""
        return False

    def _all_to_all_as_produced(self, send: torch.Tensor, recv: torch.Tensor, produce: OnRow, meanwhile: Task) -> None:
        for j in range(self.world_size):
            produce(j)
        handle = self._all_to_all(send, recv, True)
        meanwhile()
        if handle is not None:
            handle.wait()

    def _count_all_to_all(self, send: torch.Tensor, recv: torch.Tensor) -> None:
        """An all-to-all's checks (ValueError) and its bytes, counted."""
        self._check_bytes(send, recv)
        if send.dim() != 2 or send.shape != recv.shape or send.shape[0] != self.world_size:
            raise ValueError(
                f"all_to_all: send {tuple(send.shape)} / recv {tuple(recv.shape)} must both be ({self.world_size}, L)"
            )
        self.bytes_sent += (self.world_size - 1) * send.shape[1]

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", async_op: bool = False) -> Any:
        """Uncompressed in-place all-reduce (warm-up phases, baselines); returns `tensor`, or
        with async_op=True a handle whose `wait()` returns it. Every backend sums the dtypes of
        `ALL_REDUCE_DTYPES` and refuses the others (TypeError) before any byte moves.

        The sum is the transport's own (gloo's ring, NCCL's or MPI's algorithm; MPI's in fp32
        for dtypes it has no type for, such as bf16), so that the DDP
        hook's warm-up equals what DDP computes over the same transport; shm adds in rank order,
        hierarchical in rank order inside the node and with its inter-node backend's all_reduce
        across nodes. So over three or more ranks two transports' float sums may differ in the
        last bits."""
        if op not in REDUCE_OPS:
            raise ValueError(f"op must be one of {REDUCE_OPS}, got {op!r}")
        if tensor.dtype not in ALL_REDUCE_DTYPES:
            names = ", ".join(str(d).replace("torch.", "") for d in ALL_REDUCE_DTYPES)
            raise TypeError(
                f"{self.name}: all_reduce sums {names} tensors (on every backend alike), got {tensor.dtype}"
            )
        self._check_device(tensor)
        if not tensor.is_contiguous():
            raise ValueError("all_reduce needs a contiguous tensor")
        if op == "mean" and not tensor.is_floating_point():
            raise TypeError(f"all_reduce(op='mean') needs a floating-point tensor, got {tensor.dtype}")
        n = self.world_size
        self.bytes_sent += 2 * (n - 1) * tensor.numel() * tensor.element_size() // n
        data = tensor.detach()  # its data, in place, also for a tensor that requires grad

        def reduce() -> torch.Tensor:
            if n > 1:
                self._all_reduce_sum(data)
                if op == "mean":
                    data.div_(n)
            return tensor

        return self.ordered(reduce, async_op=async_op)

    def barrier(self) -> None:
        """Wait until every rank of the group reaches this point."""
        if self.world_size > 1:
            self.ordered(self._barrier)

    def _in_turn(
        self, start: Callable[..., Handle | None], send: torch.Tensor, recv: torch.Tensor, async_op: bool
    ) -> Handle:
        """Run a byte collective in its turn. Inside a running compcomm call (which holds the
        channel) an async collective starts on the wire at once and returns its own handle."""
        if self._in_call():
            handle = start(send, recv, async_op)
            if async_op and handle is not None:
                return handle
            if handle is not None:
                handle.wait()
            return Done()

        def blocking() -> None:
            handle = start(send, recv, False)
            if handle is not None:
                handle.wait()

        if async_op:
            return self.ordered(blocking, async_op=True)
        self.ordered(blocking)
        return Done()

    def _in_call(self) -> bool:
        """Whether this thread runs a compcomm call holding all of this backend's channels."""
        return all(ordering.holds(ch) for ch in self.channels)

    def _check_bytes(self, send: torch.Tensor, recv: torch.Tensor) -> None:
        for t in (send, recv):
            if t.dtype != torch.uint8 or not t.is_contiguous() or t.device != send.device:
                raise ValueError(f"{self.name}: collectives take contiguous uint8 buffers on one device")
        self._check_device(send)

    def _check_device(self, tensor: torch.Tensor) -> None:
        """ValueError for a buffer on a device this backend does not serve, before any byte
        moves: a transport that refused it mid-call would leave a composite call's other level
        waiting (so the hierarchical backend would have to break both of its groups)."""
        if not self.serves(tensor.device):
            raise ValueError(f"{self.name}: buffers on {tensor.device} cannot go through this backend")

    @abstractmethod
    def _all_gather(self, send: torch.Tensor, recv: torch.Tensor, async_op: bool) -> Handle | None:
        """Start (async_op) or do the all-gather; return a handle to wait on, or None if done."""

    @abstractmethod
    def _all_to_all(self, send: torch.Tensor, recv: torch.Tensor, async_op: bool) -> Handle | None:
        """Start (async_op) or do the all-to-all; return a handle to wait on, or None if done."""

    @abstractmethod
    def _all_reduce_sum(self, tensor: torch.Tensor) -> None: ...

    @abstractmethod
    def _barrier(self) -> None: ...

    def __repr__(self) -> str:
        return f"<{type(self).__name__} rank {self.rank} of {self.world_size} on {self.device}>"


class _Failure:
    """The first exception of a caller's callbacks, kept until the transfers are done."""

    def __init__(self) -> None:
        self.first: Exception | None = None

    def guard(self, fn: Callable[..., None]) -> Callable[..., None]:
        """`fn`, with its exceptions kept here instead of raised."""

        def guarded(*args: int) -> None:
            try:
                fn(*args)
            except Exception as exc:
                if self.first is None:
                    self.first = exc

        return guarded

    def raise_first(self) -> None:
        if self.first is not None:
            raise self.first

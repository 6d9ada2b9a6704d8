"""shm: the ranks of one host exchange bytes through one shared-memory segment.

`get("shm", group=G)` serves CPU tensors among the ranks of a torch.distributed group G whose
members all run on this host (a node's ranks; the hierarchical backend's intra-node level).
Where gloo sends every byte through loopback TCP (a socket write and read, and the kernel's work
between), each rank here copies its block into the segment once and its peers copy it out once,
at memory speed: 1.4-6x gloo's speed at 100 MiB, more for small calls. G itself carries no
traffic: its key-value store serves the rendezvous that makes a segment, and the collectives
synchronize through counters in the segment.

Each backend object has its own segment (`backends/shm_segment.py`: layout, creation, cleanup):
one slot per rank, sized to the largest call so far and replaced by a larger one, collectively,
when a call needs more: the call first agrees on itself in the present segment, so that ranks
passing different sizes get a ValueError on every rank rather than some waiting there for the
others gone to make a new one (and a new segment takes the largest size any rank asks for).
Its name is unlinked as soon as every rank has mapped it, so a crashed or killed rank
leaves nothing in /dev/shm; the memory goes when the last rank unmaps it (`close()`, the
backend's collection, or the process's exit). Segments are numbered per group in call order; a
rendezvous that timed out leaves the group's numbering out of step, so after a timeout, as after
any collective's, the job ends rather than building new shm backends over that group.

Protocol. Each rank owns a phase counter in its control line; between calls every rank has
posted the same count c. A call:
1. waits until every counter is at least c: every peer has finished reading the previous call
   out of this rank's slot, which this rank may now overwrite;
2. writes its own slot (what its peers need from it) and its call's descriptor, posts c + 1 and
   waits until every counter is at least c + 1, then checks that every rank made the same call;
3. copies what it needs out of its peers' slots (an all-reduce first sums the chunk it owns,
   in rank order, into its own slot, posts and waits once more, then copies the others' chunks);
4. posts its last count ("done reading") without waiting: the next call's step 1 waits for it.
A barrier is steps 1, 2 and 4 with nothing in the slots. No rank ever writes another rank's slot or line.

Waits poll the counters, yielding the core for the first 100 us (ranks of one host may share
cores) and then sleeping for 1/50 of the time waited so far (at most 1 ms): the added latency
stays near 2% and a waiting rank does not steal a core from the peer it waits for. Every wait is
bounded by `timeout` (default: the group's own, 30 minutes unless set), and a peer whose process
is gone is noticed within 0.2 s: either raises RuntimeError naming the ranks, and every backend
over the group refuses further calls (its peers' counters are out of step; the group's channel is
broken: `ordering.break_channel`).

Memory ordering. The signals are plain aligned int64 stores and loads through a numpy view of the
mapping (one 8-byte move each, single-copy atomic on x86-64). Correctness rests on x86's total
store order (TSO): a core's stores become visible to the others in program order, and its loads
are not reordered with older loads, nor its stores with older loads. So
- the writer's slot stores (torch's or numpy's copy loops; glibc's memcpy, whose non-temporal
  stores it fences with sfence itself) come before its counter store, and a reader loads the
  slot only after loading that counter value: it sees the data (store-store and load-load order:
  what a release/acquire pair would give);
- a reader's loads of a slot come before its "done" store, so once the writer loads "done" it
  may overwrite the slot (load-store order).
Nothing in between can be reordered by a compiler: the copies and the counter accesses are
separate calls out of the interpreter into torch's and numpy's compiled code, and a copy that
torch spreads over threads joins them before returning. No mmap/memoryview slice writes are
used for signals. On a machine without TSO (ARM, POWER) these plain stores would need barriers,
so the backend refuses to run there and names gloo.
"""

from __future__ import annotations

import datetime
import os
import platform
import time
import weakref
from collections.abc import Callable, Hashable
from typing import Any

import torch
import torch.distributed as dist

from . import ordering
from .base import ALL_REDUCE_DTYPES, Backend, Handle
from .rank_order import sum_in_rank_order
from .shm_segment import SHM_DIRECTORY, RendezvousTimeout, Segment, alive, open_segment
from .torch_dist import (
    group_key,
    group_timeout,
    made_before_this_world,
    made_under_a_destroyed_group,
    require_member,
    world_ranks_of,
)
from .waiting import timeout_seconds

_TSO_MACHINES = ("x86_64", "amd64", "i386", "i686")
_YIELD_S = 100e-6  # waits shorter than this poll between sched_yield()s
_PAUSE_FRACTION = 1 / 50
_SHORTEST_PAUSE_S, _LONGEST_PAUSE_S = 50e-6, 1e-3
_LIVENESS_EVERY_S = 0.2
_SLOT_ALIGN = 64 * 1024  # slot sizes: multiples of 64 KiB, grown by at least half at a time
_CHUNK_ALIGN = 16  # elements: the all-reduce's per-rank chunks start on vector boundaries

_ALL_GATHER, _ALL_TO_ALL, _BARRIER, _ALL_REDUCE, _EXCHANGE_BLOCKS = 1, 2, 3, 16, 32


def runs_here() -> bool:
    """Whether this machine orders stores as the backend's signals need (x86: TSO)."""
    return platform.machine().lower() in _TSO_MACHINES


class _Rendezvous:
    """A channel's transport: the group's store under compcomm's prefix, and the number of
    segments made over it, which is the same on every rank (segments are made inside calls,
    and calls run in one order per group)."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.made = 0

    def next_key(self) -> str:
        self.made += 1
        return f"segment{self.made}"


class _Mapping:
    """The backend's segment, kept apart from the backend so that its finalizer can unmap it."""

    def __init__(self) -> None:
        self.segment: Segment | None = None

    def release(self) -> None:
        segment, self.segment = self.segment, None
        if segment is not None:
            segment.close()


class ShmBackend(Backend):
    """Collectives through shared memory among the ranks of `group` (None: the default group),
    all on this host. `timeout` (seconds or a timedelta; default: the group's) bounds every
    wait; `directory` is where the segment is created (POSIX shared memory: /dev/shm).

    Results are those of gloo bitwise: all_gather and all_to_all move bytes; all_reduce sums in
    the tensor's dtype in rank order, ((x0 + x1) + x2) + ..., rounding after each addition as
    gloo does (the same bits as gloo's on two ranks and wherever the sum is exact; on more ranks
    gloo's ring adds in another order), and every rank gets the same bits.
    """

    name = "shm"

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        timeout: float | datetime.timedelta | None = None,
        directory: str = SHM_DIRECTORY,
    ) -> None:
        super().__init__()
        if not runs_here():
            raise RuntimeError(
                f"the shm backend's signals rely on x86's total store order, and this machine is "
                f"{platform.machine()}: use backend 'gloo' (or the hierarchical backend with intra='gloo')"
            )
        require_member(group, self.name, "gloo")
        self.group = group
        if timeout is None:
            timeout = group_timeout(group, torch.device("cpu"))
        self.timeout = timeout_seconds(timeout)
        self.directory = directory
        self._rank, self._size = dist.get_rank(group), dist.get_world_size(group)
        self._world = dist.group.WORLD  # the default group its ranks were counted under
        self._key = group_key("shm", group)  # fixed: after a new default group, not the new group's
        self._mapping = _Mapping()
        weakref.finalize(self, self._mapping.release)
        self._count = 0  # this rank's phase counter in the current segment
        self._pids: list[int] = []
        self._watch = False  # whether peers' pids are visible here (same pid namespace)
        self._failed: str | None = None

    def _channel_key(self) -> Hashable:
        return self._key

    def world_ranks(self) -> list[int] | None:
        return world_ranks_of(self.group)

    def check_current(self) -> None:
        """Its rank and size are those of the default group it was built under: refused once that
        group is destroyed (even for group=None), rather than waiting for ranks that are gone."""
        if dist.group.WORLD is not self._world:
            raise made_under_a_destroyed_group(self.name)

    def _open_transport(self) -> Any:
        ordering.retire(made_before_this_world)
        ranks = ",".join(map(str, dist.get_process_group_ranks(self.group or dist.group.WORLD)))
        return _Rendezvous(dist.PrefixStore(f"compcomm/shm/{ranks}/", dist.distributed_c10d._get_default_store()))

    rank = property(lambda self: self._rank, doc="This rank's number in the group.")
    world_size = property(lambda self: self._size, doc="The number of ranks in the group.")

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def close(self) -> None:
        """Unmap this rank's segment once the calls in flight are done; the backend then refuses
        calls. Local (no peer waits for it); the memory goes when every rank has closed or exited.
        After a timeout broke the group's channel there is no turn to wait for: unmapped at once."""
        if self._failed is None:
            self._failed = "the shm backend was closed"
        if self._mapping.segment is None:
            return
        if ordering.broken(self._channel_key()) is not None or dist.group.WORLD is not self._world:
            self._mapping.release()
        else:
            self.ordered(self._mapping.release)

    # -- the segment and the counters ----------------------------------------------------------

    def _segment_for(self, slot_bytes: int) -> Segment:
        """The segment, replaced by a larger one when a slot must hold `slot_bytes` (a collective:
        every rank asks for the same size at the same call)."""
        if self._failed is not None:
            raise RuntimeError(f"shm backend unusable: {self._failed}")
        segment = self._mapping.segment
        if segment is not None and segment.slot_bytes >= slot_bytes:
            return segment
        grown = max(slot_bytes, _SLOT_ALIGN if segment is None else segment.slot_bytes * 3 // 2)
        grown = -(-grown // _SLOT_ALIGN) * _SLOT_ALIGN
        self._mapping.release()  # peers still reading it keep their own mappings
        rendezvous = self.transport
        try:
            segment = open_segment(
                rendezvous.store,
                rendezvous.next_key(),
                self._rank,
                self._size,
                grown,
                self.timeout,
                self.directory,
            )
        except RendezvousTimeout as exc:
            self._failed = str(exc)
            raise self._break_channel(str(exc)) from exc
        except RuntimeError as exc:  # agreed on every rank (e.g. ranks of several hosts): still in step
            self._failed = str(exc)
            raise
        self._mapping.segment, self._count = segment, 0
        self._pids = segment.pids()
        self._watch = all(alive(pid) for pid in self._pids)
        return segment

    def _start(self, kind: int, slot_bytes: int, what: str) -> Segment:
        """Steps 1-2's start: a segment with room, every peer done with the previous call.

        A call that needs a larger segment first agrees on itself in the present one (steps 1,
        2 and 4 with its descriptor alone): ranks passing different sizes, of which only some
        need the larger segment, are then told so (ValueError on every rank) instead of some
        waiting here for the others gone to make a new one."""
        segment = self._mapping.segment
        if segment is not None and segment.slot_bytes < slot_bytes:
            self._await(segment, self._count, "the previous call")
            segment.describe(kind, slot_bytes)
            self._step(segment, what)
            self._check_same_call(segment, what)
            self._finish(segment)
        segment = self._segment_for(slot_bytes)
        self._await(segment, self._count, "the previous call")
        segment.describe(kind, slot_bytes)
        return segment

    def _step(self, segment: Segment, what: str) -> None:
        """Post this rank's next count and wait for every rank to post it."""
        self._count += 1
        segment.post(self._count)
        self._await(segment, self._count, what)

    def _finish(self, segment: Segment) -> None:
        """Post "done reading" without waiting."""
        self._count += 1
        segment.post(self._count)

    def _check_same_call(self, segment: Segment, what: str) -> None:
        """ValueError on every rank (each sees every descriptor) when ranks made different calls."""
        calls = segment.descriptors()
        if len(set(calls)) > 1:
            self._finish(segment)
            raise ValueError(f"shm {what}: ranks made different calls (kind, bytes per rank): {calls}")

    def _await(self, segment: Segment, value: int, what: str) -> None:
        """Until every counter is at least `value`, within the timeout; a dead peer fails fast."""
        if segment.reached(value):
            return
        start = time.monotonic()
        deadline, next_check = start + self.timeout, start + _LIVENESS_EVERY_S
        while not segment.reached(value):
            now = time.monotonic()
            if now >= deadline:
                self._fail(
                    f"{what} did not complete within {self.timeout:g}s: rank(s) {segment.behind(value)} "
                    "of its group never arrived (hung, or out of step)"
                )
            if now >= next_check:
                behind = segment.behind(value)
                dead = [q for q in behind if not alive(self._pids[q])] if self._watch else []
                if dead:
                    self._fail(f"{what} cannot complete: the process of rank(s) {dead} of its group exited")
                gone = segment.left(behind)
                if gone:
                    self._fail(f"{what} cannot complete: rank(s) {gone} of its group left a call after a failure")
                next_check = now + _LIVENESS_EVERY_S
            waited = now - start
            if waited < _YIELD_S:
                os.sched_yield()
            else:
                time.sleep(min(max(waited * _PAUSE_FRACTION, _SHORTEST_PAUSE_S), _LONGEST_PAUSE_S))

    def abandon(self, reason: str) -> None:
        """Leave the group's calls out of step (see `Backend.abandon`): the peers waiting on this
        rank's counter see it within 0.2 s, as they would see its process exit."""
        if self._failed is None:
            self._failed = reason
        segment = self._mapping.segment
        if segment is not None:
            segment.leave()
        super().abandon(reason)

    def _fail(self, message: str) -> None:
        self._failed = (
            f"the shm backend failed: {message}. Its peers are out of step, so every shm backend over its "
            "group is unusable; end the job and restart from a checkpoint"
        )
        raise self._break_channel(self._failed)

    # -- the collectives -----------------------------------------------------------------------

    def _others(self) -> tuple[slice, slice]:
        """The rows of the ranks before and after this one."""
        return slice(0, self._rank), slice(self._rank + 1, None)

    def _all_gather(self, send: torch.Tensor, recv: torch.Tensor, async_op: bool) -> Handle | None:
        size = send.numel()
        recv[self._rank].copy_(send)
        if self._size == 1:  # an empty call still meets its peers: theirs may not be empty
            return None
        segment = self._start(_ALL_GATHER, size, "all_gather")
        segment.slots[self._rank, :size].copy_(send)
        self._step(segment, "all_gather")
        self._check_same_call(segment, "all_gather")
        for rows in self._others():
            recv[rows].copy_(segment.slots[rows, :size])
        self._finish(segment)
        return None

    def _all_to_all(self, send: torch.Tensor, recv: torch.Tensor, async_op: bool) -> Handle | None:
        n, me, length = self._size, self._rank, send.shape[1]
        recv[me].copy_(send[me])
        if n == 1:  # an empty call still meets its peers: theirs may not be empty
            return None
        segment = self._start(_ALL_TO_ALL, n * length, "all_to_all")
        mine = segment.slots[me, : n * length].view(n, length)
        for rows in self._others():
            mine[rows].copy_(send[rows])
        self._step(segment, "all_to_all")
        self._check_same_call(segment, "all_to_all")
        for_me = segment.slots[:, me * length : (me + 1) * length]  # block `me` of every slot
        for rows in self._others():
            recv[rows].copy_(for_me[rows])
        self._finish(segment)
        return None

    def _all_reduce_sum(self, tensor: torch.Tensor) -> None:  # dtype checked by `all_reduce`
        flat, n, me = tensor.view(-1), self._size, self._rank
        numel, nbytes = flat.numel(), flat.numel() * flat.element_size()
        chunk = -(-numel // (n * _CHUNK_ALIGN)) * _CHUNK_ALIGN
        segment = self._start(_ALL_REDUCE + ALL_REDUCE_DTYPES.index(tensor.dtype), nbytes, "all_reduce")
        slots = segment.slots[:, :nbytes].view(tensor.dtype)
        slots[me].copy_(flat)
        self._step(segment, "all_reduce")
        self._check_same_call(segment, "all_reduce")
        lo, hi = min(me * chunk, numel), min((me + 1) * chunk, numel)
        if hi > lo:  # this rank's chunk, summed in rank order into its own slot
            part = sum_in_rank_order([slots[q, lo:hi] for q in range(n)], flat[lo:hi])
            slots[me, lo:hi].copy_(part)
        self._step(segment, "all_reduce")
        for q in range(n):
            lo, hi = min(q * chunk, numel), min((q + 1) * chunk, numel)
            if q != me and hi > lo:
                flat[lo:hi].copy_(slots[q, lo:hi])
        self._finish(segment)

    def exchange_blocks(
        self, flat: torch.Tensor, size: int, dtype: torch.dtype, combine: Callable[[list[torch.Tensor]], object]
    ) -> None:
        """An all-to-all of the `size`-element blocks of the 1-D `flat` (converted to `dtype`,
        zero beyond its end) that copies nothing out: `combine(blocks)` gets block `rank` of every
        rank's `flat`, in rank order, its own a view of `flat` (or a padded copy) and its peers'
        views of their slots, valid only during the call (what the caller computes from them,
        e.g. a reduce-scatter's sum, is its own). Each rank copies into its slot only the blocks
        its peers read. bytes_sent counts the (n-1) blocks, as for that all-to-all."""
        if dtype not in ALL_REDUCE_DTYPES:
            raise TypeError(f"the shm backend cannot exchange {dtype} blocks")
        if flat.dim() != 1 or flat.numel() > self._size * size:
            raise ValueError(f"exchange_blocks: flat {tuple(flat.shape)} must be 1-D, at most {self._size} x {size}")
        self.bytes_sent += (self._size - 1) * size * dtype.itemsize
        self.ordered(self._exchange_blocks, flat, size, dtype, combine)

    def _exchange_blocks(
        self, flat: torch.Tensor, size: int, dtype: torch.dtype, combine: Callable[[list[torch.Tensor]], object]
    ) -> None:
        n, me = self._size, self._rank
        own = flat[me * size : (me + 1) * size]
        if own.numel() < size or own.dtype != dtype:  # a short or converted block: padded copy
            own = _block(flat, me, torch.empty(size, dtype=dtype, device=flat.device))
        if n == 1:  # an empty call still meets its peers: theirs may not be empty
            combine([own] * n)
            return
        nbytes = n * size * own.element_size()
        segment = self._start(_EXCHANGE_BLOCKS + ALL_REDUCE_DTYPES.index(dtype), nbytes, "exchange_blocks")
        mine = segment.slots[me, :nbytes].view(dtype)
        for q in range(n):
            if q != me:
                _block(flat, q, mine[q * size : (q + 1) * size])
        self._step(segment, "exchange_blocks")
        self._check_same_call(segment, "exchange_blocks")
        try:
            combine(
                [
                    own if q == me else segment.slots[q, :nbytes].view(dtype)[me * size : (me + 1) * size]
                    for q in range(n)
                ]
            )
        finally:
            self._finish(segment)  # the peers may write their slots again

    def _barrier(self) -> None:
        segment = self._start(_BARRIER, 0, "barrier")
        self._step(segment, "barrier")
        self._check_same_call(segment, "barrier")
        self._finish(segment)  # the descriptor read: peers may overwrite theirs after this

    def __repr__(self) -> str:
        return f"<ShmBackend rank {self._rank} of {self._size} on this host>"


def _block(flat: torch.Tensor, index: int, into: torch.Tensor) -> torch.Tensor:
    """`into` <- block `index` (into.numel() elements) of `flat`, converted, zero beyond its end."""
    size = into.numel()
    real = flat[index * size : (index + 1) * size]
    into[: real.numel()].copy_(real)
    into[real.numel() :].zero_()
    return into

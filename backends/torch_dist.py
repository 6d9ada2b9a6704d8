"""Shared transport over a torch.distributed process group (gloo and NCCL differ only in device)."""

from __future__ import annotations

import datetime
from collections.abc import Hashable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from . import ordering
from .base import Backend, Handle, OnRow, Task

DIRECT_GATHER_BYTES = 128 * 1024
"""On gloo, an all-gather of at most this many bytes per rank goes as an all-to-all of n copies
of the message, each rank sending it straight to every other: the same bytes per rank, (n - 1)
messages, but one latency instead of the n - 1 steps of gloo's ring, which is what a small
message pays for. Beyond this size the ring wins (its steps are bandwidth-bound, and the copies
would cost memory); the crossover was measured on a simulated cluster (bench/results/README.md).
It is also the row width beyond which `all_to_all_as_produced` sends row by row. NCCL keeps its
own collectives."""

P2P_TAG = 0
"""The point-to-point tag of `_all_gather_arriving` and `_all_to_all_as_produced`: compcomm's
private group carries no other point-to-point traffic, one call runs on it at a time, and each
of the two waits for all of its messages before it returns."""


class TorchDistBackend(Backend):
    """Collectives on a torch.distributed group (`group=None`: the default group)."""

    name = "torch"
    device_type = "cpu"
    pg_backend = "gloo"

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        require_member(group, self.name, self.pg_backend)
        used = dist.get_backend(group)
        if self.pg_backend not in str(used):
            raise RuntimeError(
                f"the {self.name} backend needs a process group with {self.pg_backend}, but this one uses "
                f"{used!r}: create one with torch.distributed.new_group(backend='{self.pg_backend}')"
            )
        self.group = group
        self._world = dist.group.WORLD  # the default group `group` was made under
        self._facts: _GroupFacts | None = None

    def _group_facts(self) -> _GroupFacts:
        """The group's channel key, rank and size, read from torch once per default group: they
        cannot change while it lives, and a call asks for them a dozen times (each a few
        microseconds of torch's lookups)."""
        world, facts = dist.group.WORLD, self._facts
        if facts is None or facts.world is not world:
            if self.group is not None and world is not self._world:
                raise made_under_a_destroyed_group(self.name)
            key, group = group_key(self.pg_backend, self.group), self.group
            facts = self._facts = _GroupFacts(world, key, dist.get_rank(group), dist.get_world_size(group))
        return facts

    def _channel_key(self) -> Hashable:
        """One private group per set of member ranks (and per initialization of torch.distributed)."""
        return self._group_facts().key

    def world_ranks(self) -> list[int] | None:
        return world_ranks_of(self.group)

    def check_current(self) -> None:
        """A backend over the default group (group=None) follows it when it is made again; one
        over a group made under a destroyed default group is refused."""
        self._group_facts()

    def _open_transport(self) -> Any:
        """A new process group of the same members and timeout, private to compcomm.

        Built directly on the default store under a prefix of compcomm's own, so that only the
        members take part and no group counter of torch's is touched (torch's `new_group` needs
        every rank of the world, and its members-only form collides with groups made before).
        """
        ordering.retire(made_before_this_world)
        group = self.group or dist.group.WORLD
        assert group is not None  # torch.distributed is initialized (checked at construction)
        ranks = dist.get_process_group_ranks(group)
        store = dist.PrefixStore(
            f"compcomm/{self.pg_backend}/{','.join(map(str, ranks))}/", dist.distributed_c10d._get_default_store()
        )
        timeout = group_timeout(group, self.device)
        if self.pg_backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            return dist.ProcessGroupNCCL(store, dist.get_rank(group), len(ranks), options)
        return dist.ProcessGroupGloo(store, dist.get_rank(group), len(ranks), timeout)

    @property
    def rank(self) -> int:
        return self._group_facts().rank

    @property
    def world_size(self) -> int:
        return self._group_facts().size

    @property
    def device(self) -> torch.device:
        return torch.device(self.device_type)

    def _all_gather(self, send: torch.Tensor, recv: torch.Tensor, async_op: bool) -> Handle | None:
        if self.pg_backend == "gloo" and send.numel() <= DIRECT_GATHER_BYTES:  # uint8: numel is bytes
            copies = send.view(1, -1).expand(recv.shape[0], -1).contiguous()
            return self.transport.alltoall_base(recv.view(-1), copies.view(-1), [], [])
        return self.transport._allgather_base(recv.view(-1), send)

    def _all_to_all(self, send: torch.Tensor, recv: torch.Tensor, async_op: bool) -> Handle | None:
        return self.transport.alltoall_base(recv.view(-1), send.view(-1), [], [])

    def _all_gather_arriving(self, send: torch.Tensor, recv: torch.Tensor, meanwhile: Task, arrived: OnRow) -> None:
        """On gloo, beyond DIRECT_GATHER_BYTES and over more than two ranks: a ring of n - 1
        point-to-point steps (the same bytes as gloo's ring all-gather), in which each row that
        comes in from the left is passed on to the right and then handed to `arrived` while the
        next step is on the wire. Elsewhere, gloo's or NCCL's own all-gather."""
        n, me = self.world_size, self.rank
        if self.pg_backend != "gloo" or n <= 2 or send.numel() <= DIRECT_GATHER_BYTES:
            super()._all_gather_arriving(send, recv, meanwhile, arrived)
            return
        recv[me].copy_(send)
        right, left = (me + 1) % n, (me - 1) % n
        row = left  # step s brings the row that left its rank s steps ago: me - 1 - s
        receiving = self.transport.recv([recv[row]], left, P2P_TAG)
        sending = self.transport.send([recv[me]], right, P2P_TAG)
        meanwhile()
        for step in range(n - 1):
            receiving.wait()
            sending.wait()
            if step < n - 2:
                sending = self.transport.send([recv[row]], right, P2P_TAG)
                receiving = self.transport.recv([recv[(row - 1) % n]], left, P2P_TAG)
            arrived(row)
            row = (row - 1) % n

    def sends_row_by_row(self, width: int) -> bool:
        return self.pg_backend == "gloo" and self.world_size > 1 and width > DIRECT_GATHER_BYTES

    def _all_to_all_as_produced(self, send: torch.Tensor, recv: torch.Tensor, produce: OnRow, meanwhile: Task) -> None:
        """On gloo beyond DIRECT_GATHER_BYTES per row: every receive posted first, then row
        (me + k) % n produced and sent at once for k = 1, ..., n - 1 (at each moment the ranks
        send to n different peers, so no link takes two senders), this rank's own row last.
        Elsewhere, gloo's or NCCL's own all-to-all after every row is produced."""
        n, me = self.world_size, self.rank
        if not self.sends_row_by_row(send.shape[1]):
            super()._all_to_all_as_produced(send, recv, produce, meanwhile)
            return
        receiving = [self.transport.recv([recv[j]], j, P2P_TAG) for j in range(n) if j != me]
        sending = []
        for k in range(1, n):
            peer = (me + k) % n
            produce(peer)
            sending.append(self.transport.send([send[peer]], peer, P2P_TAG))
        produce(me)
        recv[me].copy_(send[me])
        meanwhile()
        for handle in receiving + sending:
            handle.wait()

    def _all_reduce_sum(self, tensor: torch.Tensor) -> None:
        self.transport.allreduce([tensor]).wait()

    def _barrier(self) -> None:
        self.transport.barrier().wait()


class GroupKey(NamedTuple):
    """The channel key of a transport over a torch.distributed group: its kind, the default group
    it was made under and its members' global ranks."""

    kind: str
    world: Any
    ranks: tuple[int, ...]


class _GroupFacts(NamedTuple):
    """What a backend reads of its group under one default group (`world`)."""

    world: Any
    key: GroupKey
    rank: int
    size: int


def group_key(kind: str, group: dist.ProcessGroup | None) -> GroupKey:
    """The key of `kind`'s transport over `group` (None: the default group), as of now."""
    return GroupKey(kind, dist.group.WORLD, tuple(dist.get_process_group_ranks(group or dist.group.WORLD)))


def world_ranks_of(group: dist.ProcessGroup | None) -> list[int] | None:
    """`Backend.world_ranks` of a backend over `group` (None: the default group)."""
    ranks = None if group is None else dist.get_process_group_ranks(group)
    return None if ranks is None or ranks == list(range(len(ranks))) else ranks


def made_under_a_destroyed_group(name: str) -> RuntimeError:
    """The error of a backend used after the default process group its group belonged to was
    destroyed."""
    return RuntimeError(
        f"this {name} backend was built over a group of a default process group that has since been "
        "destroyed: build it again over a group of the present one"
    )


def made_before_this_world(key: Hashable) -> bool:
    """Whether `key` is a torch group's made under a default group that has been destroyed
    since (`ordering.retire` closes its channel once idle: nothing can call it any more)."""
    return isinstance(key, GroupKey) and key.world is not dist.group.WORLD


def require_member(group: dist.ProcessGroup | None, name: str, pg_backend: str) -> None:
    """RuntimeError naming init_process_group unless torch.distributed is initialized; ValueError
    unless this process is a member of `group` (None: the default group)."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"the {name} backend needs torch.distributed: call "
            f"torch.distributed.init_process_group('{pg_backend}') first (torchrun sets the "
            "environment it reads), or pass backend='mpi' under mpirun"
        )
    if group is not None and dist.get_rank(group) < 0:
        raise ValueError(f"this process (global rank {dist.get_rank()}) is not a member of the given group")


def group_timeout(group: dist.ProcessGroup | None, device: torch.device) -> datetime.timedelta:
    """The caller's group timeout (None: the default group's), so that a dead peer fails
    compcomm's calls as soon as theirs (torch's default, 30 minutes, where the group does not say)."""
    group = group if group is not None else dist.group.WORLD
    try:
        if group is not None:
            return group._get_backend(device).options._timeout
    except (AttributeError, RuntimeError):
        pass
    return datetime.timedelta(minutes=30)

"""The hierarchical transport: two groups, this node's ranks and the ranks of this local index.

`HierarchicalBackend(intra, inter)` joins n = k * H ranks: `intra` holds the k ranks of this node
(a fast link: NVLink, shared memory, loopback), `inter` the H ranks of the same local index on
every node (the slow network). This rank is number `inter.rank * k + intra.rank` (node-major, as
torchrun numbers them). Compressed calls over it run the hierarchical schedule
(`compcomm.schedules.hierarchical`: exact inside a node, 1-bit between nodes); this module only
moves bytes. The uncompressed byte collectives (all_gather, all_to_all, all_reduce, barrier) are
composed from the two levels, so the backend is accepted anywhere a backend is (optimizers'
warm-up, the DDP hook). `bytes_sent` is what this rank handed to both transports.
"""

from __future__ import annotations

import contextlib
import datetime
import numbers
import os
import weakref
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from . import ordering
from .base import AGREED, ALL_REDUCE_DTYPES, Backend, Handle
from .gloo import GlooBackend
from .nccl import NcclBackend
from .rank_order import sum_in_rank_order
from .shm import ShmBackend
from .shm import runs_here as shm_runs_here
from .torch_dist import group_timeout


class HierarchicalBackend(Backend):
    """A backend over intra-node x inter-node groups; compressed calls reduce exactly inside a node."""

    name = "hierarchical"

    def __init__(self, intra: Backend, inter: Backend) -> None:
        if not isinstance(intra, Backend) or not isinstance(inter, Backend):
            raise TypeError("hierarchical(intra, inter) takes two compcomm Backends")
        if intra.device.type != inter.device.type:
            raise ValueError(f"intra ({intra.device}) and inter ({inter.device}) backends must serve one device type")
        self.intra, self.inter = intra, inter
        self._scratch: list[torch.Tensor] = []  # one reused receive buffer per tensor of a call
        super().__init__()
        self._check_grouping()

    def _check_grouping(self) -> None:
        """ValueError on every rank unless `inter` joins ranks of one local index of nodes of one
        size, every node's ranks see as many nodes, and every local index lists the nodes in one
        order: else each node's parts would be reduced with other local indices' parts, or rank
        r of the composite would not be one rank, into results that differ from rank to rank.
        A node is known by a random token of its local rank 0."""
        mine = torch.tensor([self.intra.rank, self.intra.world_size, self.inter.world_size], dtype=torch.int64)
        across, within = _gathered(self.inter, mine), _gathered(self.intra, mine)
        bad = self._anywhere((across[:, :2] != mine[:2]).any() or (within[:, 1:] != mine[1:]).any())
        if not bad:  # the groups' shapes agree everywhere: compare the nodes' order
            token = torch.tensor([int.from_bytes(os.urandom(8), "little", signed=True)], dtype=torch.int64)
            order = _gathered(self.inter, _gathered(self.intra, token)[0]).view(-1)
            bad = self._anywhere((_gathered(self.intra, order) != order).any())
        if bad:
            raise ValueError(
                "hierarchical(intra, inter): `inter` must join the ranks of one local index (the same "
                "intra.rank) on nodes of the same size, one per node, and every local index's inter group "
                "must order the nodes alike; some rank's inter group mixes local indices or node sizes, or "
                "lists the nodes in another order. Build inter from the ranks with the same local index, in "
                "node order, e.g. compcomm.backends.get('hierarchical')"
            )

    def _anywhere(self, found: Any) -> bool:
        """Whether any rank of the composite `found` something (through both levels)."""
        for group in (self.intra, self.inter, self.intra):
            found = _gathered(group, torch.tensor([int(bool(found))], dtype=torch.int64)).any()
        return bool(found)

    def abandon(self, reason: str) -> None:
        self.intra.abandon(reason)
        self.inter.abandon(reason)

    def check_current(self) -> None:
        self.intra.check_current()
        self.inter.check_current()

    @contextlib.contextmanager
    def leaving_on_failure(self) -> Iterator[None]:
        """A call over both levels that fails on one of them (a RuntimeError that was not agreed,
        `base.AGREED`: its transport) may have left this rank's peers on the other one waiting
        mid-call: abandon both, so that they raise too, and so that this rank's next call does
        not pair with their pending one. An agreed error leaves every rank in step."""
        try:
            yield
        except RuntimeError as exc:
            if not getattr(exc, AGREED, False):
                self.abandon(f"a hierarchical call failed on this rank ({exc})")
            raise

    # The count lives in the two transports; the generic accounting's writes are ignored.
    @property
    def bytes_sent(self) -> int:
        return self.intra.bytes_sent + self.inter.bytes_sent

    @bytes_sent.setter
    def bytes_sent(self, value: int) -> None:
        pass

    @property
    def rank(self) -> int:
        return self.inter.rank * self.intra.world_size + self.intra.rank

    @property
    def world_size(self) -> int:
        return self.intra.world_size * self.inter.world_size

    @property
    def device(self) -> torch.device:
        return self.intra.device

    def serves(self, device: torch.device) -> bool:
        return self.intra.serves(device) and self.inter.serves(device)

    @property
    def channel(self) -> ordering.Channel:
        """The intra-node group's channel."""
        return self.intra.channel

    @property
    def channels(self) -> list[ordering.Channel]:
        return [*self.intra.channels, *self.inter.channels]

    def _channel_key(self) -> Hashable:
        return ("hierarchical", self.intra._channel_key(), self.inter._channel_key())

    def _open_transport(self) -> Any:
        raise RuntimeError("a hierarchical backend has no transport of its own")

    # -- exact collectives inside the node -------------------------------------------------------

    def _received(self, slot: int, rows: int, size: int, dtype: torch.dtype) -> torch.Tensor:
        """A (rows, size) buffer of `dtype` for the call's tensor number `slot`, reused from call
        to call (one call runs at a time on this backend's channels): fresh pages of a large
        buffer cost more to fault in here than the reduction itself. Each slot grows to its
        largest call and is held until the backend goes."""
        nbytes = rows * size * torch.empty((), dtype=dtype).element_size()
        while len(self._scratch) <= slot:
            self._scratch.append(torch.empty(0, dtype=torch.uint8, device=self.device))
        if self._scratch[slot].numel() < nbytes:
            self._scratch[slot] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self._scratch[slot][:nbytes].view(dtype).view(rows, size)

    def exchange_in_node(
        self,
        flat: torch.Tensor,
        size: int,
        dtype: torch.dtype,
        combine: Callable[[list[torch.Tensor], torch.Tensor], object],
        slot: int = 0,
    ) -> torch.Tensor:
        """The node's blocks of `flat` for this rank's part (`size` elements of `dtype`, local
        rank i owning [i size, (i+1) size), zero beyond the tensor), handed to
        `combine(blocks, part)` in local rank order to write this rank's part; returns the part.
        The blocks may be views of the shm segment, valid only during `combine`, and `part` may
        share memory with blocks[0]. The part lives in the reused buffer of `slot` (one per
        tensor of a call) until the next call."""
        k = self.intra.world_size
        if isinstance(self.intra, ShmBackend) and dtype in ALL_REDUCE_DTYPES:  # read in place, fewer copies
            part = self._received(slot, 1, size, dtype)[0]
            self.intra.exchange_blocks(flat, size, dtype, lambda blocks: combine(blocks, part))
            return part
        if flat.dtype == dtype and flat.numel() == k * size and flat.is_contiguous():
            send = flat.view(k, size)  # already in place: no copy
        else:
            send = torch.zeros(k, size, dtype=dtype, device=flat.device)
            send.view(-1)[: flat.numel()].copy_(flat)
        received = self._received(slot, k, size, dtype)
        self.intra.all_to_all(send.view(torch.uint8), received.view(torch.uint8))
        combine(list(received), received[0])
        return received[0]

    def _gather_parts(self, part: torch.Tensor) -> torch.Tensor:
        """(k, S): every local rank's part, in local rank order."""
        everyone = torch.empty(self.intra.world_size, part.numel(), dtype=part.dtype, device=part.device)
        self.intra.all_gather(part.view(torch.uint8), everyone.view(torch.uint8))
        return everyone

    # -- byte collectives composed from the two levels ----------------------------------------------

    def _all_gather(self, send: torch.Tensor, recv: torch.Tensor, async_op: bool) -> Handle | None:
        node = torch.empty(self.intra.world_size, send.numel(), dtype=torch.uint8, device=send.device)
        with self.leaving_on_failure():
            self.intra.all_gather(send, node)
            self.inter.all_gather(node.view(-1), recv.view(self.inter.world_size, -1))
        return None

    def _all_to_all(self, send: torch.Tensor, recv: torch.Tensor, async_op: bool) -> Handle | None:
        """Inside the node first (each block to the local rank of its destination's index), then
        across nodes (each rank forwards its node's blocks for one local index)."""
        k, h, length = self.intra.world_size, self.inter.world_size, send.shape[1]
        by_local = send.view(h, k, length).transpose(0, 1).contiguous()
        mixed = torch.empty_like(by_local)
        with self.leaving_on_failure():
            self.intra.all_to_all(by_local.view(k, -1), mixed.view(k, -1))
            by_node = mixed.transpose(0, 1).contiguous()
            self.inter.all_to_all(by_node.view(h, -1), recv.view(h, -1))
        return None

    def _all_reduce_sum(self, tensor: torch.Tensor) -> None:
        """Exact: reduce-scatter inside the node (rank order), all-reduce across nodes, all-gather."""
        flat = tensor.view(-1)
        with self.leaving_on_failure():
            part = self.exchange_in_node(
                flat, -(-flat.numel() // self.intra.world_size), tensor.dtype, sum_in_rank_order
            )
            self.inter.all_reduce(part, "sum")
            flat.copy_(self._gather_parts(part).view(-1)[: flat.numel()])

    def _barrier(self) -> None:
        with self.leaving_on_failure():
            self.intra.barrier()
            self.inter.barrier()
            self.intra.barrier()


def _gathered(be: Backend, values: torch.Tensor) -> torch.Tensor:
    """Every rank of `be`'s int64 `values`, as rows."""
    send = values.to(be.device).view(torch.uint8)
    recv = torch.empty(be.world_size, send.numel(), dtype=torch.uint8, device=be.device)
    be.all_gather(send, recv)
    return recv.view(torch.int64).cpu()


def hierarchical(intra: Backend, inter: Backend) -> HierarchicalBackend:
    """A backend that reduces exactly over `intra` (this node's ranks) and with 1 bit over
    `inter` (the ranks of this local index on every node); see the module
    `compcomm.backends.hierarchical`. A collective (call it on every rank): groups that do not fit
    that layout are a ValueError on every rank."""
    return HierarchicalBackend(intra, inter)


def from_torch(
    local_world_size: int | None = None, transport: str | None = None, intra: str | None = None
) -> HierarchicalBackend:
    """The hierarchical backend of the default torch.distributed group, with `local_world_size`
    ranks per node (default: LOCAL_WORLD_SIZE, set by torchrun) numbered node-major.

    `transport` joins the nodes ("gloo" or "nccl"; default: the default group's). `intra` joins
    the ranks of one node: "shm", "gloo" or "nccl". The default is "shm" (shared memory) under
    gloo on x86, because a node's CPU ranks share its memory, and copying through it beats gloo's
    loopback TCP 1.4-6x per collective (bench/results/README.md); gloo on other machines, whose
    store order the shm backend's signals do not rely on; under nccl, nccl itself, which picks
    NVLink or shared memory inside a node on its own. Every choice gives bitwise the same
    results: inside a node only bytes move, and the reduce-scatter sums in local rank order.

    Makes one group per node and one per local index, collectively: every rank must call it.
    The ranks first agree on the layout (a ValueError on every rank where one rank's is bad or
    differs: their groups would not pair), and the groups keep the default group's timeout."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "get('hierarchical') needs torch.distributed: call torch.distributed.init_process_group() first"
        )
    world, rank = dist.get_world_size(), dist.get_rank()
    try:
        layout, problem = _layout(local_world_size, transport, intra, world), ""
    except (TypeError, ValueError) as exc:
        layout, problem = (0, "", ""), f"{type(exc).__name__}: {exc}"
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, (problem, layout))
    failed = [r for r, (why, _) in enumerate(everyone) if why]
    if failed:
        raise ValueError(f"rank(s) {failed}: {everyone[failed[0]][0]}")
    if any(theirs != layout for _, theirs in everyone):
        raise ValueError(
            f"ranks passed different layouts (local_world_size, transport, intra per rank: "
            f"{[theirs for _, theirs in everyone]}): every rank must build the same nodes"
        )
    k, transport, intra = layout
    timeout = group_timeout(None, torch.device("cuda" if transport == "nccl" else "cpu"))
    nodes = _groups([[h * k + i for i in range(k)] for h in range(world // k)], timeout)
    peers = _groups([[h * k + i for h in range(world // k)] for i in range(k)], timeout)
    return HierarchicalBackend(
        _TRANSPORTS[intra](group=nodes[rank // k]), _TRANSPORTS[transport](group=peers[rank % k])
    )


_TRANSPORTS: dict[str, type[GlooBackend] | type[NcclBackend] | type[ShmBackend]] = {
    "gloo": GlooBackend,
    "nccl": NcclBackend,
    "shm": ShmBackend,
}


def _layout(local_world_size: int | None, transport: str | None, intra: str | None, world: int) -> tuple[int, str, str]:
    """This rank's (ranks per node, transport, intra) for `from_torch`; ValueError if bad."""
    if local_world_size is None:
        if "LOCAL_WORLD_SIZE" not in os.environ:
            raise ValueError(
                "get('hierarchical') needs the ranks per node: set LOCAL_WORLD_SIZE (torchrun does) "
                "or pass local_world_size="
            )
        text = os.environ["LOCAL_WORLD_SIZE"]
        try:
            local_world_size = int(text)
        except ValueError:
            raise ValueError(f"LOCAL_WORLD_SIZE must be an integer (the ranks per node), got {text!r}") from None
    k = local_world_size
    if isinstance(k, bool) or not isinstance(k, numbers.Integral):  # a float made other groups on this rank
        raise TypeError(f"local_world_size must be an integer, got {type(k).__name__} {k!r}")
    if k < 1 or world % k:
        raise ValueError(f"{world} ranks cannot form nodes of {k} ranks (local_world_size must divide the world size)")
    transport = transport or ("nccl" if "nccl" in str(dist.get_backend()) else "gloo")
    intra = intra or ("shm" if transport == "gloo" and shm_runs_here() else transport)
    if transport not in ("gloo", "nccl"):
        raise ValueError(f"transport must be one of gloo, nccl, got {transport!r}")
    if intra not in _TRANSPORTS:
        raise ValueError(f"intra must be one of {', '.join(_TRANSPORTS)}, got {intra!r}")
    return k, transport, intra


_made: dict[tuple[tuple[int, ...], datetime.timedelta], Any] = {}
"""The groups `from_torch` made, by members and timeout: weakly (torch holds them while they
live), or torch's mark for a group this rank is not a member of."""
_made_under: list[weakref.ref[Any]] = []  # the default group they were made under


def _groups(members: Sequence[list[int]], timeout: datetime.timedelta) -> list[Any]:
    """One torch group per member list, made once per default group: `from_torch` called again
    (as every rank calls it, alike) takes the same groups, where new ones would each keep
    their sockets and threads for the life of the default group."""
    if not _made_under or _made_under[0]() is not dist.group.WORLD:
        _made.clear()
        _made_under[:] = [weakref.ref(dist.group.WORLD)]
    groups = []
    for ranks in members:
        key = (tuple(ranks), timeout)
        kept = _made.get(key)
        group = kept() if isinstance(kept, weakref.ref) else kept
        if group is None:
            group = dist.new_group(ranks, timeout=timeout)
            _made[key] = group if group == dist.GroupMember.NON_GROUP_MEMBER else weakref.ref(group)
        groups.append(group)
    return groups

"""Hierarchical compression: exact inside a node, 1-bit only between nodes.

`HierarchicalBackend(intra, inter)` joins n = k * H ranks: `intra` holds the k ranks of this
node (a fast link: NVLink, shared memory, loopback), `inter` the H ranks of the same local index
on every node (the slow network). This rank is number `inter.rank * k + intra.rank` (node-major,
as torchrun numbers them). For a tensor of N elements the compressed allreduce runs:

    parts:      S = ceil(N / 8k) * 8; local rank i owns elements [iS, iS + N_i), N_i = clamp(N - iS, 0, S)
    reduce-scatter (exact, fp32): all-to-all of the fp32 parts inside the node, then on rank i
                z_i = ((x_0 + x_1) + x_2) + ...   summed in local rank order over part i,
                v_i = z_i / k for op="mean", z_i for op="sum"
    across nodes: the 1-bit algorithm of `compressed_allreduce` (same op) on v_i over `inter`,
                with this rank's ErrorFeedback, which therefore holds part i: (N_i, H)
    all-gather: every part's phase-2 bytes (its servers' t_j and packed signs) inside the node;
                every rank decodes every part from them, in the tensor's dtype

so the output is the 1-bit mean over nodes of the node means (or the sum of the node sums for
"sum"), bitwise identical on all n ranks, since all decode the same bytes. Only inter-node bytes
are 1-bit: per rank about 2 (H-1)/H * N/(8k) bytes between nodes; inside the node (k-1)/k * 4N
bytes of fp32 parts (an all-to-all reduce-scatter sends half the bytes of an fp32 all-reduce, so
it is the one used) and about (k-1)/k * N/8 bytes of results. Each rank runs the worker and
server codec on N/k elements instead of N, and decodes all N.

A tensor below `min_compress_bytes` takes the same route with the exact path across nodes
(fp32 chunks summed in node order, / H for "mean"): the exact mean of the node means.

Errors (SPEC-like, across both levels): first this rank's own checks and an agreement over all n
ranks (count, sequence, numel, op, dtype, ErrorFeedback tag), then, after the reduce-scatter, the
across-node phase 0 on every part (non-finite sums, overflow) and an intra-node agreement on every
part's verdict, so a rejection on one inter group is raised on every rank with the same error.
Nothing (tensor, error state) changes before all of that has passed.

`bytes_sent` is what this rank handed to both transports. The uncompressed byte collectives
(all_gather, all_to_all, all_reduce, barrier) are composed from the two levels, so the backend is
accepted anywhere a backend is (optimizers' warm-up, the DDP hook).
"""

from __future__ import annotations

import os
from collections.abc import Hashable, Sequence
from typing import Any

import torch

from compcomm import ordering
from compcomm.error_feedback import ErrorFeedback
from compcomm.layout import chunk_size, real_count

from .base import Backend, Handle


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
        """The intra-node group's channel (where the composite also keeps its count of calls)."""
        return self.intra.channel

    @property
    def channels(self) -> list[ordering.Channel]:
        return [*self.intra.channels, *self.inter.channels]

    def sequence_number(self) -> int:
        """The number of this composite's compressed call now running (counted per composite,
        since the intra group's own tickets also count calls one node makes on its own)."""
        return self.intra.channel.agreed.get(self._channel_key(), 0)

    def _channel_key(self) -> Hashable:
        return ("hierarchical", self.intra._channel_key(), self.inter._channel_key())

    def _open_transport(self) -> Any:
        raise RuntimeError("a hierarchical backend has no transport of its own")

    def part(self, numel: int) -> tuple[int, int]:
        """(elements, ranks) of the part of a `numel`-element tensor this rank reduces across nodes."""
        return real_count(self.intra.rank, numel, self.intra.world_size), self.inter.world_size

    # -- the compressed collective ---------------------------------------------------------------

    def compressed_schedule(
        self,
        tensors: list[torch.Tensor],
        efs: list[ErrorFeedback],
        op: str,
        min_compress_bytes: int | None = None,
        outs: list[ErrorFeedback] | None = None,
    ) -> list[torch.Tensor]:
        """compressed_allreduce(_coalesced) over this backend; runs holding both channels. A
        tensor below `min_compress_bytes` is reduced exactly across nodes too; `outs` receive
        the errors after the call (None: `efs` themselves)."""
        from compcomm import allreduce

        counts = self.intra.channel.agreed  # this composite's calls, counted where every rank sees them
        counts[self._channel_key()] = counts.get(self._channel_key(), -1) + 1
        exact = allreduce.agree(tensors, efs, self, op, self.part, min_compress_bytes, outs)
        parts = [self._reduce_scatter(t.detach().reshape(-1), torch.float32, i) for i, t in enumerate(tensors)]
        if op == "mean":
            for part in parts:
                part.div_(self.intra.world_size)
        real = [p[: self.part(t.numel())[0]] for p, t in zip(parts, tensors)]
        calls: list[allreduce.PreparedCall] = []
        failure: Exception | None = None
        try:
            calls = allreduce.prepare_coalesced(real, efs, self.inter, op, [t.dtype for t in tensors], exact, outs)
        except Exception as exc:  # agreed on this inter group: now agreed inside the node too
            failure = exc
        self._agree_inside_node(failure)
        for call, tensor in zip(calls, tensors):
            call.commit()
            self._share_result(call, tensor)
        return tensors

    def _share_result(self, call: Any, tensor: torch.Tensor) -> None:
        """All-gather every part's phase-2 bytes (1 bit per element) inside the node, then every
        rank decodes every part from the same bytes: the tensor, bitwise equal everywhere."""
        from compcomm.allreduce import decode_result

        k, numel = self.intra.world_size, tensor.numel()
        size = chunk_size(numel, k)
        longest = self._result_bytes(size, call.exact)
        mine = torch.zeros(longest, dtype=torch.uint8, device=self.device)
        mine[: call.result.numel()].copy_(call.result.view(-1))
        everyone = torch.empty(k, longest, dtype=torch.uint8, device=self.device)
        self.intra.all_gather(mine, everyone)
        flat = tensor.detach().reshape(-1)
        for i in range(k):
            real = real_count(i, numel, k)
            if real:
                rows = everyone[i, : self._result_bytes(real, call.exact)].view(self.inter.world_size, -1)
                decode_result(rows, flat[i * size : i * size + real], call.exact)
        if flat.data_ptr() != tensor.data_ptr() or not tensor.is_contiguous():
            tensor.detach().copy_(flat.view(tensor.shape))

    def _result_bytes(self, numel: int, exact: bool) -> int:
        """Bytes of phase 2's result of a `numel`-element call across the H nodes."""
        from compcomm.allreduce import SERVER_SCALE_BYTES

        h = self.inter.world_size
        return h * 4 * chunk_size(numel, h) if exact else h * (SERVER_SCALE_BYTES + chunk_size(numel, h) // 8)

    def _agree_inside_node(self, failure: Exception | None) -> None:
        """Raise, on every rank of the node, the verdict of the lowest local index that failed.

        Each inter group's verdict is the same on all its ranks, so every node picks the same one."""
        from compcomm.allreduce import ERRORS, error_code, gather_messages

        k = self.intra.world_size
        code = 0 if failure is None else error_code(failure)
        codes = torch.empty(k, 1, dtype=torch.uint8, device=self.device)
        self.intra.all_gather(torch.tensor([code], dtype=torch.uint8, device=self.device), codes)
        failed = [i for i, c in enumerate(codes.view(-1).tolist()) if c]
        if not failed:
            return
        first = failed[0]
        text = gather_messages(str(failure or ""), self.intra)[first]
        cls = ERRORS[int(codes[first, 0]) - 1]
        raise cls(f"across nodes, part {first} of {k}: {text}") from failure

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

    def _reduce_scatter(self, flat: torch.Tensor, dtype: torch.dtype, slot: int = 0) -> torch.Tensor:
        """This rank's part (S elements of `dtype`, zero beyond the tensor) of the node's sum,
        added in local rank order: an all-to-all of the parts, then a local sum. It lives in the
        reused buffer until the next call."""
        k = self.intra.world_size
        size = chunk_size(flat.numel(), k)
        if flat.dtype == dtype and flat.numel() == k * size and flat.is_contiguous():
            send = flat.view(k, size)  # already in place: no copy
        else:
            send = torch.zeros(k, size, dtype=dtype, device=flat.device)
            send.view(-1)[: flat.numel()].copy_(flat)
        received = self._received(slot, k, size, dtype)
        self.intra.all_to_all(send.view(torch.uint8), received.view(torch.uint8))
        total = received[0]
        for row in received[1:]:
            total += row
        return total

    def _gather_parts(self, part: torch.Tensor) -> torch.Tensor:
        """(k, S): every local rank's part, in local rank order."""
        everyone = torch.empty(self.intra.world_size, part.numel(), dtype=part.dtype, device=part.device)
        self.intra.all_gather(part.view(torch.uint8), everyone.view(torch.uint8))
        return everyone

    # -- byte collectives composed from the two levels ----------------------------------------------

    def _all_gather(self, send: torch.Tensor, recv: torch.Tensor, async_op: bool) -> Handle | None:
        node = torch.empty(self.intra.world_size, send.numel(), dtype=torch.uint8, device=send.device)
        self.intra.all_gather(send, node)
        self.inter.all_gather(node.view(-1), recv.view(self.inter.world_size, -1))
        return None

    def _all_to_all(self, send: torch.Tensor, recv: torch.Tensor, async_op: bool) -> Handle | None:
        """Inside the node first (each block to the local rank of its destination's index), then
        across nodes (each rank forwards its node's blocks for one local index)."""
        k, h, length = self.intra.world_size, self.inter.world_size, send.shape[1]
        by_local = send.view(h, k, length).transpose(0, 1).contiguous()
        mixed = torch.empty_like(by_local)
        self.intra.all_to_all(by_local.view(k, -1), mixed.view(k, -1))
        by_node = mixed.transpose(0, 1).contiguous()
        self.inter.all_to_all(by_node.view(h, -1), recv.view(h, -1))
        return None

    def _all_reduce_sum(self, tensor: torch.Tensor) -> None:
        """Exact: reduce-scatter inside the node (rank order), all-reduce across nodes, all-gather."""
        flat = tensor.view(-1)
        part = self._reduce_scatter(flat, tensor.dtype)
        self.inter.all_reduce(part, "sum")
        flat.copy_(self._gather_parts(part).view(-1)[: flat.numel()])

    def _barrier(self) -> None:
        self.intra.barrier()
        self.inter.barrier()
        self.intra.barrier()


def hierarchical(intra: Backend, inter: Backend) -> HierarchicalBackend:
    """A backend that reduces exactly over `intra` (this node's ranks) and with 1 bit over
    `inter` (the ranks of this local index on every node); see `backends.hierarchical`."""
    return HierarchicalBackend(intra, inter)


def from_torch(local_world_size: int | None = None, transport: str | None = None) -> HierarchicalBackend:
    """The hierarchical backend of the default torch.distributed group, with `local_world_size`
    ranks per node (default: LOCAL_WORLD_SIZE, set by torchrun) numbered node-major.

    Makes one group per node and one per local index, collectively: every rank must call it."""
    import torch.distributed as dist

    from . import get

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "get('hierarchical') needs torch.distributed: call torch.distributed.init_process_group() first"
        )
    if local_world_size is None:
        if "LOCAL_WORLD_SIZE" not in os.environ:
            raise ValueError(
                "get('hierarchical') needs the ranks per node: set LOCAL_WORLD_SIZE (torchrun does) "
                "or pass local_world_size="
            )
        local_world_size = int(os.environ["LOCAL_WORLD_SIZE"])
    world, rank, k = dist.get_world_size(), dist.get_rank(), local_world_size
    if k < 1 or world % k:
        raise ValueError(f"{world} ranks cannot form nodes of {k} ranks (local_world_size must divide the world size)")
    transport = transport or ("nccl" if "nccl" in str(dist.get_backend()) else "gloo")
    nodes = _groups([[h * k + i for i in range(k)] for h in range(world // k)])
    peers = _groups([[h * k + i for h in range(world // k)] for i in range(k)])
    return HierarchicalBackend(get(transport, group=nodes[rank // k]), get(transport, group=peers[rank % k]))


def _groups(members: Sequence[list[int]]) -> list[Any]:
    import torch.distributed as dist

    return [dist.new_group(ranks) for ranks in members]

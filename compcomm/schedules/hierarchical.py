"""Hierarchical compression: exact inside a node, 1-bit only between nodes.

Over a `HierarchicalBackend(intra, inter)` of n = k * H ranks (`intra`: the k ranks of this node,
`inter`: the H ranks of this local index on every node; this rank is `inter.rank * k +
intra.rank`), a call on a tensor of N elements runs:

    parts:      S = ceil(N / 8k) * 8; local rank i owns elements [iS, iS + N_i), N_i = clamp(N - iS, 0, S)
    agreement:  this rank's checks and phase 0 over all n ranks (count, sequence, numel, op, dtype,
                ErrorFeedback tag, exactness), each ErrorFeedback serving its part (N_i, H)
    reduce-scatter (exact, fp32): all-to-all of the fp32 parts inside the node, then on rank i
                z_i = ((x_0 + x_1) + x_2) + ...   summed in local rank order over part i,
                v_i = z_i / k for op="mean", z_i for op="sum"
    across nodes: the flat 1-bit allreduce (`compcomm.schedules.flat`, same op) of v_i over
                `inter`, with this rank's ErrorFeedback, which therefore holds part i: (N_i, H);
                its phase-0 verdict (non-finite sums, overflow) is then agreed inside the node
    all-gather: every part's phase-2 bytes (its servers' t_j and packed signs) inside the node;
                every rank decodes every part from them, in the tensor's dtype (its own part
                as its phase 2 arrives, the others after the all-gather)

so the output is the 1-bit mean over nodes of the node means (or the sum of the node sums for
"sum"), bitwise identical on all n ranks, since all decode the same bytes. Only inter-node bytes
are 1-bit: per rank about 2 (H-1)/H * N/(8k) bytes between nodes; inside the node (k-1)/k * 4N
bytes of fp32 parts and about (k-1)/k * N/8 bytes of results. Each rank runs the worker and
server codec on N/k elements instead of N, and decodes all N. Its worker scan reads the node's
blocks where they lie and forms v_i as it goes (see `allreduce`), so that the node step costs
the exchange alone, with no pass of its own for the sum or the division.

A tensor below `min_compress_bytes` takes the same route with the exact path across nodes (fp32
chunks summed in node order, / H for "mean"): the exact mean of the node means. Nothing (tensor,
error state) changes before every verdict has passed on every rank.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

from .. import codec
from ..agreement import CallSpec, Measured, agree_on_call, raise_agreed
from ..backends.hierarchical import HierarchicalBackend
from ..backends.ordering import Channel
from ..backends.rank_order import sum_in_rank_order
from ..error_feedback import ALLREDUCE, Served
from ..layout import chunk_size, real_count
from . import flat

_calls: weakref.WeakKeyDictionary[Channel, weakref.WeakKeyDictionary[Channel, int]] = weakref.WeakKeyDictionary()
"""Each composite's count of compressed calls, by its (intra, inter) channels: the two groups'
own tickets also count calls that one node or one local index makes on its own, so neither
numbers a composite call alike on all n ranks."""


_ACROSS_NODES = (
    "across nodes (the ranks named below are node indices, and the values there each node's fp32 sum "
    "of its ranks' parts, or that sum / ranks per node for op='mean', which can overflow where the "
    "mean would not): "
)


def part_of(be: HierarchicalBackend, numel: int) -> Served:
    """(elements, ranks, layout, rank) of the part of a `numel`-element tensor this rank reduces
    across nodes: what its ErrorFeedback serves (the rank is this one's among all the ranks:
    the node's ranks reduce different parts across the same nodes)."""
    return real_count(be.intra.rank, numel, be.intra.world_size), be.inter.world_size, ALLREDUCE, be.rank


def allreduce(spec: CallSpec, be: HierarchicalBackend) -> list[torch.Tensor]:
    """Run `spec` over the composite `be`; runs holding both levels' channels. A transport that
    fails under it leaves both levels abandoned (`HierarchicalBackend.leaving_on_failure`)."""
    with be.leaving_on_failure():
        return _allreduce(spec, be)


def _allreduce(spec: CallSpec, be: HierarchicalBackend) -> list[torch.Tensor]:
    """The call of `allreduce`.

    The first tensor's node step runs last and the call across nodes starts inside it, while
    the node's blocks are at hand: where the first tensor is compressed and its scan writes x',
    that scan reads the node's blocks in place and forms z_i / k as it goes (`CallSpec.formed`),
    so the node's sum and mean are never written out (for k > 2 the first k - 1 blocks are
    summed in a pass, the last added in the scan: the same rank order, the same bits)."""
    count = len(spec.tensors)
    exact = _agree_over_all_ranks(spec, be)
    outs = [_flat_output(t) for t in spec.tensors]
    divisor = float(be.intra.world_size) if spec.op == "mean" else 1.0
    parts: list[torch.Tensor] = [torch.empty(0)] * count
    formed: list[tuple[torch.Tensor | None, float]] = [(None, 1.0)] * count

    def written_mean(blocks: list[torch.Tensor], part: torch.Tensor) -> None:
        codec.divide_(sum_in_rank_order(blocks, part), divisor)

    for i in range(1, count):
        parts[i] = _node_step(be, outs[i], i, written_mean)[: part_of(be, outs[i].numel())[0]]
    calls: list[flat.FlatCall] = []
    failure: Exception | None = None

    def first_then_across(blocks: list[torch.Tensor], part: torch.Tensor) -> None:
        nonlocal calls, failure
        real = part_of(be, outs[0].numel())[0]
        if exact[0] or not spec.into(0).scan_writes_x_prime(spec.error_feedbacks[0]):
            written_mean(blocks, part)
            parts[0] = part[:real]
        else:
            head = sum_in_rank_order(blocks[:-1], part) if len(blocks) > 2 else blocks[0]
            parts[0] = head[:real]
            formed[0] = (blocks[-1][:real] if len(blocks) > 1 else None, divisor)
        across = CallSpec(
            parts,
            spec.error_feedbacks,
            spec.op,
            spec.outs,
            exact=exact,
            result_dtypes=[t.dtype for t in spec.tensors],
            outputs=[_own_part(be, out) for out in outs],  # decoded there as phase 2 arrives
            formed=formed,
            limits=spec.limits,
            owner=be.rank,
        )
        try:
            calls = flat.prepare(across, be.inter)
        except Exception as exc:  # agreed on this inter group: now agreed inside the node too
            failure = exc

    _node_step(be, outs[0], 0, first_then_across)
    raise_agreed(failure, be.intra, context=_ACROSS_NODES)
    for call, tensor, out in zip(calls, spec.tensors, outs):
        call.commit()
        _share_result(be, call, tensor, out)
    return spec.tensors


def _flat_output(tensor: torch.Tensor) -> torch.Tensor:
    """Where the call reads the tensor and writes its result: its flat view, or a contiguous copy
    (which `_share_result` copies back), so that the scan and the decode take contiguous memory."""
    flat = tensor.detach().reshape(-1)
    return flat if flat.is_contiguous() else flat.contiguous()


def _own_part(be: HierarchicalBackend, out: torch.Tensor) -> torch.Tensor:
    """This rank's part of the flat output `out`."""
    start = be.intra.rank * chunk_size(out.numel(), be.intra.world_size)
    return out[start : start + part_of(be, out.numel())[0]]


def _node_step(
    be: HierarchicalBackend, flat: torch.Tensor, i: int, combine: Callable[[list[torch.Tensor], torch.Tensor], object]
) -> torch.Tensor:
    """The exchange inside the node of tensor i (`flat`): `combine(blocks, part)` on the node's
    fp32 blocks of this rank's part (see `HierarchicalBackend.exchange_in_node`); returns the
    part's buffer."""
    size = chunk_size(flat.numel(), be.intra.world_size)
    return be.exchange_in_node(flat, size, torch.float32, combine, slot=i)


def _agree_over_all_ranks(spec: CallSpec, be: HierarchicalBackend) -> list[bool]:
    """Phase 0 over all n ranks, before any data moves: this rank's checks (each ErrorFeedback
    serving its part) and which tensors go exact. Returns those flags."""
    counts = _calls.setdefault(be.intra.channel, weakref.WeakKeyDictionary())
    counts[be.inter.channel] = sequence = counts.get(be.inter.channel, -1) + 1
    agree_on_call(
        spec,
        be,
        "hierarchical",
        sequence,
        lambda i: Measured(0.0),  # the sums are bounded across nodes, after the reduce-scatter
        lambda numel: part_of(be, numel),
        fold=False,
    )
    return [spec.reduced_exactly(i) for i in range(len(spec.tensors))]


def _share_result(be: HierarchicalBackend, call: flat.FlatCall, tensor: torch.Tensor, out: torch.Tensor) -> None:
    """All-gather every part's phase-2 bytes (1 bit per element) inside the node, then every
    rank decodes the other parts from the same bytes (its own, decoded as its phase 2 arrived,
    came from them too) into `out`, the flat tensor or its copy: bitwise equal everywhere."""
    assert call.result is not None
    k, h, numel = be.intra.world_size, be.inter.world_size, tensor.numel()
    size = chunk_size(numel, k)
    longest = flat.result_bytes(size, h, call.exact)
    mine = torch.zeros(longest, dtype=torch.uint8, device=be.device)
    mine[: call.result.numel()].copy_(call.result.view(-1))
    everyone = torch.empty(k, longest, dtype=torch.uint8, device=be.device)
    be.intra.all_gather(mine, everyone)
    for i in range(k):
        real = real_count(i, numel, k)
        if real and i != be.intra.rank:
            rows = everyone[i, : flat.result_bytes(real, h, call.exact)].view(h, -1)
            flat.decode_result(rows, out[i * size : i * size + real], call.exact)
    if out.data_ptr() != tensor.data_ptr() or not tensor.is_contiguous():
        tensor.detach().copy_(out.view(tensor.shape))

"""Which memory a tensor's elements occupy, for the checks that keep a call from writing over
its own inputs: a tensor whose elements overlap (expand()), two tensors of one call with an
element in common (each result would overwrite the other's), a tensor inside an error state.

Views are compared by the elements they address, not by their allocations: views interleaved in
one buffer (x[0::2], x[1::2]) or column blocks of one weight are separate tensors to a call.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

Span = tuple[int, int, int]
"""(storage address, first byte, byte past the last) of the memory a tensor's elements lie in."""

MARKS_LIMIT = 1 << 28
"""Elements of the largest span whose views `share_elements` marks one by one (256 MiB of
marks); views of one storage spanning more count as sharing."""


def span(tensor: torch.Tensor) -> Span:
    """The memory the tensor's elements lie in (negative strides included)."""
    size = tensor.element_size()
    first = tensor.data_ptr() + size * sum(st * (n - 1) for n, st in zip(tensor.shape, tensor.stride()) if st < 0)
    last = tensor.data_ptr() + size * sum(st * (n - 1) for n, st in zip(tensor.shape, tensor.stride()) if st > 0)
    return tensor.untyped_storage().data_ptr(), first, last + size


def overlaps_itself(tensor: torch.Tensor) -> bool:
    """Whether two indices of the tensor address the same element. Strides decide at once in
    the usual layouts: sorted by stride, each dimension steps past everything the smaller ones
    span (no overlap), or one has stride 0 (expand: overlap). Interleaved strides (shape (2, 3),
    strides (3, 2) addresses 0, 2, 4, 3, 5, 7) are settled element by element."""
    dims = sorted((stride, size) for size, stride in zip(tensor.shape, tensor.stride()) if size > 1)
    extent = 0
    for stride, size in dims:
        if stride <= extent:
            return stride == 0 or _offsets_repeat(tensor)
        extent += stride * (size - 1)
    return False


def _offsets_repeat(tensor: torch.Tensor) -> bool:
    """Whether two of the tensor's elements lie at one offset (8 bytes per element, once)."""
    offsets = torch.zeros((), dtype=torch.int64)
    for d, (size, stride) in enumerate(zip(tensor.shape, tensor.stride())):
        along = [1] * tensor.dim()
        along[d] = size
        offsets = offsets + (torch.arange(size, dtype=torch.int64) * stride).view(along)
    flat = offsets.reshape(-1)
    return torch.unique(flat).numel() < flat.numel()


def share_elements(tensors: Sequence[torch.Tensor], spans: Sequence[Span]) -> bool:
    """Whether two of `tensors` (of `spans`, `span` each) address a common element. Tensors whose
    spans in one storage intersect (directly or through others) form a cluster, whose elements
    are then marked view by view; spans apart need no marks."""
    cluster: list[int] = []
    storage, end = None, 0
    for (other, first, last), k in sorted((s, k) for k, s in enumerate(spans)):
        if cluster and other == storage and first < end:
            cluster.append(k)
            end = max(end, last)
            continue
        if _cluster_shares([tensors[j] for j in cluster], [spans[j] for j in cluster]):
            return True
        cluster, storage, end = [k], other, last
    return _cluster_shares([tensors[j] for j in cluster], [spans[j] for j in cluster])


def any_in(spans: Sequence[Span], buffers: Sequence[torch.Tensor]) -> bool:
    """Whether a span intersects one of `buffers` (a few per call: compared byte range by byte
    range, only those in a storage of `spans`)."""
    storages = {storage for storage, _, _ in spans}
    held = [span(t) for t in buffers if t.numel() and t.untyped_storage().data_ptr() in storages]
    return any(s == h and first < end and start < stop for s, start, end in spans for h, first, stop in held)


def _cluster_shares(views: list[torch.Tensor], spans: list[Span]) -> bool:
    """Whether views of one storage whose spans intersect share an element: each marks its
    elements in a byte per element of the cluster's span (on the CPU, whatever their device)
    after checking that none is marked yet. Views of other element sizes or alignments, or a span
    of more than `MARKS_LIMIT` elements, count as sharing."""
    if len(views) < 2:
        return False
    size = views[0].element_size()
    base, end = min(s[1] for s in spans), max(s[2] for s in spans)
    misaligned = any(v.element_size() != size or (v.data_ptr() - base) % size for v in views)
    if misaligned or (end - base) // size > MARKS_LIMIT:
        return True
    marks = torch.zeros((end - base) // size, dtype=torch.bool)
    for v in views:
        mine = torch.as_strided(marks, v.shape, v.stride(), (v.data_ptr() - base) // size)
        if mine.any():
            return True
        mine.fill_(True)
    return False

"""The sum in rank order, ((x_0 + x_1) + x_2) + ...: the one order in which compcomm adds the
terms of an exact reduction (a schedule's exact rows and node sums, the shm and hierarchical
backends' uncompressed all-reduce), so that every transport gives the same bits."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def sum_in_rank_order(terms: Sequence[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """out <- ((terms[0] + terms[1]) + terms[2]) + ..., all of one dtype; `out` may be terms[0]
    itself (the sum is element-wise), but may share no memory with a later term, which it would
    overwrite before reading it (ValueError). Returns out."""
    if any(term.dtype != out.dtype for term in terms):
        raise ValueError(f"sum_in_rank_order: terms {[t.dtype for t in terms]} and out {out.dtype} differ in dtype")
    if any(_overlap(term, out) for term in terms[1:]):
        raise ValueError("sum_in_rank_order: `out` shares memory with a term after the first")
    if len(terms) == 1:
        return out.copy_(terms[0])
    torch.add(terms[0], terms[1], out=out)
    for term in terms[2:]:
        out.add_(term)
    return out


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the memory spans of a and b (first to last byte they may touch) intersect."""
    if a.numel() == 0 or b.numel() == 0 or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False

    def span(t: torch.Tensor) -> tuple[int, int]:
        start = t.data_ptr()
        return start, start + sum(
            (n - 1) * abs(st) for n, st in zip(t.shape, t.stride())
        ) * t.element_size() + t.element_size()

    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1

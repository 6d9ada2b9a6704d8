"""The sum in rank order, ((x_0 + x_1) + x_2) + ...: the one order in which compcomm adds the
terms of an exact reduction (a schedule's exact rows and node sums, the shm and hierarchical
backends' uncompressed all-reduce), so that every transport gives the same bits."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def sum_in_rank_order(terms: Sequence[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """out <- ((terms[0] + terms[1]) + terms[2]) + ... in out's dtype; `out` may be terms[0]
    itself (the sum is element-wise), but no later term. Returns out."""
    if len(terms) == 1:
        return out.copy_(terms[0])
    torch.add(terms[0], terms[1], out=out)
    for term in terms[2:]:
        out.add_(term)
    return out

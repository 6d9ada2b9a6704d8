"""The schedules of the compressed collectives: which collectives run, in what order, on which group.

Every schedule starts with the same agreement (`compcomm.agreement`, phase 0) and uses the same
codec (`compcomm.codec`); they differ in how the bytes travel:

- `flat`: the 1-bit allreduce over one group (all-to-all of signs, server pass, all-gather);
- `hierarchical`: exact inside a node, `flat` across nodes, over a `HierarchicalBackend`;
- `reduce_scatter`: the 1-bit reduce-scatter (one all-to-all; each row decoded by its owner).

`allreduce(spec, be)` picks the allreduce schedule from the backend's declared type.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..agreement import CallSpec
from ..backends import Backend, HierarchicalBackend
from ..error_feedback import Served
from . import flat, hierarchical
from .reduce_scatter import reduce_scatter as _reduce_scatter


def allreduce(spec: CallSpec, be: Backend) -> list[torch.Tensor]:
    """Run the compressed allreduce `spec` over `be`, inside the caller's turn on its channels."""
    if isinstance(be, HierarchicalBackend):
        return hierarchical.allreduce(spec, be)
    return flat.allreduce(spec, be)


def serves(be: Backend) -> Callable[[int], Served]:
    """What the ErrorFeedback of a numel-element tensor holds after an allreduce over `be`:
    (elements, ranks, layout, this rank), for checking saved errors before they are loaded."""
    if isinstance(be, HierarchicalBackend):
        return lambda numel: hierarchical.part_of(be, numel)
    return flat.serves(be, be.rank)


def reduce_scatter(spec: CallSpec, be: Backend) -> list[torch.Tensor]:
    """Run the compressed reduce-scatter `spec` over `be` (a flat group: two levels take HSDP)."""
    if isinstance(be, HierarchicalBackend):
        raise TypeError(
            "the compressed reduce-scatter runs over one group; for nodes of several ranks, shard inside "
            "each node and average across nodes (compcomm.fsdp.compress(model, replicate_group=...))"
        )
    return _reduce_scatter(spec, be)

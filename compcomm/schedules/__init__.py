"""The schedules of the compressed collectives: which collectives run, in what order, on which group.

Every schedule starts with the same agreement (`compcomm.agreement`, phase 0) and uses the same
codec (`compcomm.codec`); they differ in how the bytes travel:

- `flat`: the 1-bit allreduce over one group (all-to-all of signs, server pass, all-gather);
- `hierarchical`: exact inside a node, `flat` across nodes, over a `HierarchicalBackend`;

`allreduce(spec, be)` picks the allreduce schedule from the backend's declared type.
"""

from __future__ import annotations

import torch

from ..agreement import CallSpec
from ..backends import Backend, HierarchicalBackend
from . import flat, hierarchical


def allreduce(spec: CallSpec, be: Backend) -> list[torch.Tensor]:
    """Run the compressed allreduce `spec` over `be`, inside the caller's turn on its channels."""
    if isinstance(be, HierarchicalBackend):
        return hierarchical.allreduce(spec, be)
    return flat.allreduce(spec, be)

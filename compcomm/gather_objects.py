"""Every rank's Python object on every rank: how one checkpoint file holds all ranks' state, and
how the ranks check that they were given the same values.

The gather runs in its turn on the backend's ordered channel, behind any compcomm reduction
still in flight, so it never pairs with the wrong messages on other ranks.
"""

from __future__ import annotations

import io
from typing import Any

import torch

from .agreement import all_sum
from .backends import Backend


def all_gather_object(obj: Any, be: Backend) -> list[Any]:
    """Every rank's `obj` (anything torch.save takes), in rank order, on every rank, its tensors
    on the CPU: loaded where they were saved, rank r's CUDA tensors would land on GPU r in every
    process (a context and a copy on each peer's GPU, or an error where a process sees one GPU)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    raw = buf.getvalue()
    mine = [0.0] * be.world_size
    mine[be.rank] = float(len(raw))
    sizes = [int(s) for s in all_sum(mine, be)]
    longest = max(sizes)
    send = torch.zeros(longest, dtype=torch.uint8)
    send[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    recv = torch.empty(be.world_size, longest, dtype=torch.uint8, device=be.device)
    be.all_gather(send.to(be.device), recv)
    rows = recv.cpu()
    return [
        torch.load(io.BytesIO(rows[r, : sizes[r]].numpy().tobytes()), map_location="cpu", weights_only=False)
        for r in range(be.world_size)
    ]


def agree_on_values(values: dict[str, Any], be: Backend, why: str) -> None:
    """ValueError on every rank unless every rank passed equal `values`: each rank compares the
    same gathered list, so all raise alike, naming the first value that differs and `why` it
    must not."""
    everyone = all_gather_object(values, be)
    missing = "(not passed)"
    for name in dict.fromkeys(k for v in everyone for k in v):  # every rank's names, in order
        column = [v.get(name, missing) for v in everyone]
        if any(c != column[0] for c in column):
            raise ValueError(f"ranks passed different {name} (per rank: {column}): {why}")

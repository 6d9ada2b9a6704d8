"""Every rank's Python object on every rank: how one checkpoint file holds all ranks' state.

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
    """Every rank's `obj` (anything torch.save takes), in rank order, on every rank."""
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
        torch.load(io.BytesIO(rows[r, : sizes[r]].numpy().tobytes()), weights_only=False) for r in range(be.world_size)
    ]

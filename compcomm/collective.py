"""Small collectives the optimizers use besides the payload: verdicts and object gathers.

Like every collective of a compcomm backend, they run in their turn on the backend's ordered
channel, behind any of the optimizer's asynchronous reductions still in flight, so they never
pair with the wrong messages on other ranks.
"""

from __future__ import annotations

import io
from typing import Any

import torch

from .backends import Backend


def all_sum(values: list[float], be: Backend) -> list[float]:
    """Element-wise sum over ranks of a few float64 numbers (exact for small integers)."""
    flat = torch.tensor(values, dtype=torch.float64, device=be.device)
    be.all_reduce(flat, "sum")
    return flat.tolist()


def raise_everywhere(problem: str | None, be: Backend) -> None:
    """ValueError on every rank if any rank has a `problem`; each rank names the first bad rank."""
    flags = [0.0] * be.world_size
    flags[be.rank] = 0.0 if problem is None else 1.0
    bad = [r for r, f in enumerate(all_sum(flags, be)) if f]
    if bad:
        if problem is not None:
            raise ValueError(problem)
        raise ValueError(
            f"rank(s) {bad} could not load their checkpoint, so no rank loaded its own (see the error on those ranks)"
        )


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

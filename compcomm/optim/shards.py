"""Sharded parameters as the optimizers see them: the part this rank holds, and the compression
that reduces their gradients.

FSDP2's parameters are DTensors. Their module is loaded only by programs that shard (importing
it costs more than all of compcomm), so a tensor is taken for one only once that module is
loaded: before that, none can exist. `compcomm.fsdp.compress` registers each parameter it
compresses here, which is how an optimizer built on those parameters finds its state.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import torch
from torch.utils.weak import WeakIdKeyDictionary

if TYPE_CHECKING:
    from ..fsdp.state import CompressionState

_compressions: WeakIdKeyDictionary = WeakIdKeyDictionary()  # parameter -> its CompressionState


def is_dtensor(t: torch.Tensor) -> bool:
    """Whether `t` is a DTensor (a sharded parameter), without loading DTensor's module."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def local(p: torch.Tensor) -> torch.Tensor:
    """The part of `p` this rank holds: its local shard for a DTensor, `p` itself otherwise. The
    update rules work on it, and the optimizer state has its shape."""
    return p.to_local() if is_dtensor(p) else p  # type: ignore[attr-defined]


def local_part(p: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """The part of `value` (broadcastable to `p`'s whole shape) that lies on `p`'s local shard:
    `value` itself for a plain tensor, else the chunk FSDP2 gives this rank (`torch.chunk` of its
    shard dimension; none for a rank past the last chunk) of the value broadcast to `p`."""
    if not is_dtensor(p):
        return value
    (placement,) = p.placements  # type: ignore[attr-defined]  # FSDP2: one shard dimension, a 1-D mesh
    dim = placement.dim
    whole = value.expand(p.shape)
    chunks = whole.chunk(p.device_mesh.size(), dim=dim)  # type: ignore[attr-defined]
    rank = p.device_mesh.get_local_rank()  # type: ignore[attr-defined]
    part = chunks[rank] if rank < len(chunks) else whole.narrow(dim, 0, 0)
    if part.shape != local(p).shape:  # a placement other than FSDP2's chunks
        raise ValueError(f"cannot place a value on a {tuple(local(p).shape)} shard of a {tuple(p.shape)} parameter")
    return part


def register(param: torch.Tensor, state: CompressionState) -> None:
    _compressions[param] = state


def compression_of(param: torch.Tensor) -> CompressionState | None:
    """The CompressionState whose FSDP module shards `param`, if `compress` was called on it."""
    return _compressions.get(param)

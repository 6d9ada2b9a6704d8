"""Padded sizes, chunk ranges, flattening and bucketing for the compressed allreduce.

The padded length M is a multiple of 8 * world_size so that every rank serves a chunk of
C = M / world_size elements that packs into whole bytes.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TypeGuard

import torch

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "Bucket",
    "Bucketer",
    "bucket_groups",
    "chunk_range",
    "chunk_size",
    "flatten",
    "padded_size",
    "real_count",
    "unflatten",
]

DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024


def padded_size(numel: int, world_size: int) -> int:
    """M = ceil(numel / (8 n)) * 8 n."""
    numel, world_size = _count("numel", numel, 0), _count("world_size", world_size, 1)
    unit = 8 * world_size
    return -(-numel // unit) * unit


def chunk_size(numel: int, world_size: int) -> int:
    """C = M / n: the number of padded elements each rank serves."""
    world_size = _count("world_size", world_size, 1)
    return padded_size(numel, world_size) // world_size


def chunk_range(rank: int, numel: int, world_size: int) -> tuple[int, int]:
    """[start, stop) of the padded elements served by `rank`."""
    rank = _count("rank", rank, 0)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world of size {world_size}")
    c = chunk_size(numel, world_size)
    return rank * c, (rank + 1) * c


def real_count(rank: int, numel: int, world_size: int) -> int:
    """k = clamp(N - jC, 0, C): how many elements of rank j's chunk are real, not padding."""
    start, stop = chunk_range(rank, numel, world_size)
    return max(0, min(_count("numel", numel, 0), stop) - start)


def is_integer(value: object) -> TypeGuard[int]:
    """Whether `value` is an integer (Python's, numpy's, ...) and not a bool: what every count,
    size and rank the library takes must be (a float gives float offsets that index nothing,
    and True would pass for 1)."""
    return type(value) is int or (not isinstance(value, bool) and isinstance(value, numbers.Integral))


def _count(name: str, value: object, low: int) -> int:
    """`value` as a Python int: TypeError unless it is an integer, ValueError below `low`. A
    numpy integer is converted, so that sizes computed from it cannot wrap in its width."""
    if not is_integer(value):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    return int(value)


def flatten(tensors: Iterable[torch.Tensor], numel: int | None = None) -> torch.Tensor:
    """Copy same-dtype, same-device tensors into one new contiguous 1-D buffer: their data, also
    of tensors that require grad (parameters), with no autograd graph (as `Bucket.gather`).

    `numel` (>= the total) sizes the buffer larger, zero-filled, e.g. to a padded size.
    """
    tensors = tensor_list(tensors, "flatten")
    if not tensors:
        raise ValueError("flatten needs at least one tensor")
    _check_uniform(tensors)
    total = sum(t.numel() for t in tensors)
    if numel is not None:
        numel = _count("numel", numel, total)
    buffer = torch.zeros(total if numel is None else numel, dtype=tensors[0].dtype, device=tensors[0].device)
    for view, t in zip(unflatten(buffer, [t.shape for t in tensors]), tensors):
        view.copy_(t.detach())
    return buffer


def tensor_list(tensors: Iterable[torch.Tensor], who: str) -> list[torch.Tensor]:
    """`tensors` as a list (also model.parameters(), a generator read once, or a ParameterList);
    TypeError, naming `who`, for a lone tensor or anything else than tensors."""
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, Iterable):
        raise TypeError(f"{who} takes tensors (a list, or model.parameters()), got {type(tensors).__name__}")
    tensors = list(tensors)
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{who} takes tensors, got {type(t).__name__} at index {i}")
    return tensors


def unflatten(buffer: torch.Tensor, shapes: Iterable[torch.Size | Sequence[int]]) -> list[torch.Tensor]:
    """Views of consecutive stretches of a 1-D buffer, shaped as given (no copy); every size of
    every shape given (no -1: a stretch's length is what its shape says)."""
    if not isinstance(buffer, torch.Tensor):
        raise TypeError(f"unflatten takes a 1-D tensor, got {type(buffer).__name__}")
    if buffer.dim() != 1:
        raise ValueError(f"unflatten takes a 1-D buffer, got shape {tuple(buffer.shape)}")
    views, offset = [], 0
    for shape in shapes:
        size = torch.Size(shape)
        if any(d < 0 for d in size):
            raise ValueError(f"unflatten takes shapes of sizes >= 0, got {tuple(size)}")
        n = size.numel()
        if offset + n > buffer.numel():
            raise ValueError("shapes need more elements than the buffer holds")
        views.append(buffer[offset : offset + n].view(size))
        offset += n
    return views


def _check_uniform(tensors: Sequence[torch.Tensor]) -> None:
    first = tensors[0]
    for t in tensors[1:]:
        if t.dtype != first.dtype or t.device != first.device:
            raise ValueError(
                "tensors to flatten together must share dtype and device, got "
                f"{first.dtype}/{first.device} and {t.dtype}/{t.device}"
            )


@dataclass
class Bucket:
    """Tensors that travel together in one collective, through one flat buffer.

    `buffer` has `padded_numel` elements; `flat` is its first `numel` (the real data) and
    `views[i]` is tensor i's slot in it.
    """

    indices: list[int]
    numel: int
    padded_numel: int
    buffer: torch.Tensor
    views: list[torch.Tensor] = field(default_factory=list)

    @property
    def flat(self) -> torch.Tensor:
        return self.buffer[: self.numel]

    def gather(self, tensors: Iterable[torch.Tensor]) -> torch.Tensor:
        """Copy this bucket's tensors (from the full list) into the buffer; return `flat`."""
        tensors = self._check_shapes(tensors)
        for view, i in zip(self.views, self.indices):
            view.copy_(tensors[i].detach())
        return self.flat

    def scatter(self, tensors: Iterable[torch.Tensor]) -> None:
        """Copy the buffer back into this bucket's tensors (from the full list): their data, also
        for tensors that require grad (parameters)."""
        tensors = self._check_shapes(tensors)
        for view, i in zip(self.views, self.indices):
            tensors[i].detach().copy_(view)

    def _check_shapes(self, tensors: Iterable[torch.Tensor]) -> Sequence[torch.Tensor]:
        """`tensors` as a list; a ValueError, before anything is copied, when the list is too
        short for this bucket or a tensor is not shaped like its slot (`copy_` would broadcast
        one into the other: a slot filled with repeated values)."""
        if not isinstance(tensors, (list, tuple)):  # a list is read as it is: a bucket per call costs its own tensors
            tensors = tensor_list(tensors, "a Bucket")
        if self.indices and len(tensors) <= self.indices[-1]:
            raise ValueError(
                f"this bucket holds tensor {self.indices[-1]} of the list it was built from, got a list of "
                f"{len(tensors)}: pass the whole list"
            )
        for view, i in zip(self.views, self.indices):
            if not isinstance(tensors[i], torch.Tensor):
                raise TypeError(f"a Bucket takes tensors, got {type(tensors[i]).__name__} at index {i}")
            if tensors[i].shape != view.shape:
                raise ValueError(
                    f"tensor {i} has shape {tuple(tensors[i].shape)}, but its slot in the bucket was laid "
                    f"out for {tuple(view.shape)}: pass the tensors the bucket was built from"
                )
        return tensors


def bucket_groups(
    tensors: Iterable[torch.Tensor], bucket_bytes: int, dtype: torch.dtype | None = None
) -> list[list[int]]:
    """The tensor indices of each bucket that `Bucketer` makes (see there), allocating nothing."""
    tensors = tensor_list(tensors, "bucket_groups")
    bucket_bytes = _count("bucket_bytes", bucket_bytes, 1)
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype or None, got {type(dtype).__name__} {dtype!r}")
    groups: list[list[int]] = []
    keys: list[tuple[torch.dtype, torch.device]] = []
    sizes: list[int] = []
    for i, t in enumerate(tensors):
        key = (dtype or t.dtype, t.device)
        nbytes = t.numel() * key[0].itemsize
        if groups and keys[-1] == key and sizes[-1] + nbytes <= bucket_bytes:
            groups[-1].append(i)
            sizes[-1] += nbytes
        else:
            groups.append([i])
            keys.append(key)
            sizes.append(nbytes)
    return groups


class Bucketer:
    """Groups tensors, in order, into buckets of at most `bucket_bytes` each.

    Tensors of different dtype or device never share a bucket; a tensor larger than
    `bucket_bytes` gets a bucket of its own. Buffers are padded for `world_size` ranks,
    so an optimizer can make one collective per bucket instead of one per parameter.
    """

    def __init__(
        self,
        tensors: Iterable[torch.Tensor],
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        world_size: int = 1,
        dtype: torch.dtype | None = None,
    ) -> None:
        tensors = tensor_list(tensors, "Bucketer")  # also model.parameters(), read once
        self.world_size = _count("world_size", world_size, 1)
        groups = bucket_groups(tensors, bucket_bytes, dtype)
        self.buckets: list[Bucket] = [self._make_bucket(tensors, idx, dtype) for idx in groups]

    def _make_bucket(self, tensors: Sequence[torch.Tensor], idx: list[int], dtype: torch.dtype | None) -> Bucket:
        first = tensors[idx[0]]
        shapes = [tensors[i].shape for i in idx]
        numel = sum(tensors[i].numel() for i in idx)
        padded = padded_size(numel, self.world_size)
        buffer = torch.zeros(padded, dtype=dtype or first.dtype, device=first.device)
        return Bucket(
            indices=list(idx), numel=numel, padded_numel=padded, buffer=buffer, views=unflatten(buffer, shapes)
        )

    def __len__(self) -> int:
        return len(self.buckets)

    def __iter__(self):
        return iter(self.buckets)

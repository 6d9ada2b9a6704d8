"""Parameters replicated on every rank: refuse ones that something else already keeps in step,
and make them equal at the start.

An optimizer that owns its communication (it averages gradients, momenta or pseudo-gradients
itself) needs plain replicated tensors: DDP would average the gradients a second time, and
sharded (DTensor) parameters hold a different piece on every rank. It also needs every rank to
start from the same values, as DDP makes them at construction; `equalize_from_rank0` does that
with a 32-byte all-gather when they already agree, and a bitwise copy of rank 0's values when
they do not.
"""

from __future__ import annotations

import gc
import itertools
import threading
import warnings
import weakref
import zlib
from collections.abc import Sequence
from typing import Any

import torch
from torch.nn.modules.module import register_module_module_registration_hook
from torch.nn.parallel import DistributedDataParallel
from torch.utils.hooks import RemovableHandle

from ..agreement import raise_agreed
from ..backends import Backend
from ..gather_objects import agree_on_values
from .shards import is_dtensor

COPY_BYTES = 4 * 1024 * 1024
"""Bytes per rank of each all-gather that copies rank 0's parameters (the all-gather receives
world_size times as much)."""

_CHUNK = 1 << 22  # elements fingerprinted at once (bounds the int64 temporaries to 32 MiB)
_MULTIPLIERS = (0x9E3779B97F4A7C15 - (1 << 64), 0xC2B2AE3D27D4EB4F - (1 << 64))  # as signed int64


def check_plain_replicas(params: Sequence[torch.Tensor], owner: str) -> None:
    """ValueError for sharded (DTensor) parameters or parameters of a DDP-wrapped module:
    `owner` communicates itself, so neither may be given to it."""
    if any(is_dtensor(p) for p in params):
        raise ValueError(
            f"{owner} does not take sharded (DTensor) parameters: it averages whole replicated "
            "parameters across ranks; build it on a model that fully_shard was not applied to"
        )
    refuse_ddp_wrapped(params, owner)


def refuse_ddp_wrapped(params: Sequence[torch.Tensor], owner: str, since_built: bool = False) -> None:
    """ValueError for parameters of a DDP-wrapped module: `owner` averages them itself, and DDP
    would average every gradient as well, silently paying twice (`since_built`: see `ddp_refusal`)."""
    refusal = ddp_refusal(params, owner, since_built)
    if refusal is not None:
        raise refusal


def ddp_refusal(params: Sequence[torch.Tensor], owner: str, since_built: bool = False) -> ValueError | None:
    """The ValueError `refuse_ddp_wrapped` raises, or None. `since_built`: the check at the first
    step, for a model wrapped after `owner` was built (which its construction could not see);
    the caller raises it on every rank alike."""
    if not _wrapped_by_ddp(params, every_object=not since_built):
        return None
    gc.collect()  # a wrapper already dropped may still be listed, waiting for a collection
    if not _wrapped_by_ddp(params, every_object=not since_built):
        return None
    if since_built:
        what = f"the model {owner} steps was wrapped in DistributedDataParallel after {owner} was built"
        fix = "keep the unwrapped module and drop the DDP wrapper"
    else:
        what = f"{owner} was given the parameters of a DistributedDataParallel model"
        fix = "pass the parameters of the unwrapped module (ddp_model.module) and drop the DDP wrapper"
    return ValueError(f"{what}: it does its own communication, and DDP would average every gradient as well; {fix}")


_DDP_MODULES: weakref.WeakSet[DistributedDataParallel] = weakref.WeakSet()
"""The live DDP modules found so far: those among every object at a walk, and each one made since
the first (`_note_ddp`); changed and read under `_DDP_LOCK` (a DDP may be built in any thread)."""
_DDP_LOCK = threading.RLock()
_noting: list[RemovableHandle] = []  # the global module registration hook, once registered


def _wrapped_by_ddp(params: Sequence[torch.Tensor], every_object: bool) -> bool:
    """Whether a live DistributedDataParallel module wraps any of `params`. DDP puts no mark on
    the parameters it wraps, so an optimizer's construction (`every_object`) finds the DDP modules
    among every object of the process (typed and filtered in C: only their distinct types go
    through `issubclass`), copies and unpickled ones included, and from then on torch's module
    registration hook notes each new one as its constructor takes its module (`self.module =
    ...`): the check at the first step, for a model wrapped after the optimizer was built, looks
    at those alone, where a second walk over the process's hundreds of thousands of objects would
    cost more than the rest of the optimizer's construction. (A DDP copied or unpickled between
    the two is not seen.) The hook is registered before the first walk, so that a DDP built in
    another thread meanwhile is in one or the other."""
    if not _noting:
        _noting.append(register_module_module_registration_hook(_note_ddp))
        every_object = True
    if every_object:
        objects = gc.get_objects()
        ddp_types = {kind for kind in set(map(type, objects)) if issubclass(kind, DistributedDataParallel)}
        found = list(itertools.compress(objects, map(ddp_types.__contains__, map(type, objects)))) if ddp_types else []
        del objects
        with _DDP_LOCK:
            _DDP_MODULES.update(found)
    with _DDP_LOCK:
        wrappers = list(_DDP_MODULES)
    ids = {id(p) for p in params}
    # a DDP whose construction failed before it took its module, or is still under way, has none
    modules = (getattr(ddp, "module", None) for ddp in wrappers)
    return any(any(id(p) in ids for p in module.parameters()) for module in modules if module is not None)


def _note_ddp(module: torch.nn.Module, name: str, submodule: torch.nn.Module | None) -> None:
    """torch's global module registration hook: a DDP module taking its module is noted."""
    if isinstance(module, DistributedDataParallel):
        with _DDP_LOCK:
            _DDP_MODULES.add(module)


def equalize_from_rank0(
    params: Sequence[torch.Tensor],
    backend: Backend,
    settings: dict[str, Any] | None = None,
    why: str = "",
    failure: Exception | None = None,
) -> bool:
    """Make `params` bitwise equal to rank 0's on every rank of `backend` (a collective).

    Returns whether they differed, in which case every rank also warns once, as DDP makes its
    replicas equal at construction. Ranks whose parameters have different shapes or dtypes
    raise the same ValueError everywhere, and so do ranks whose `settings` differ (naming the
    first that does, and `why` it must not: `gather_objects.agree_on_values`), and so does a
    `failure` of this rank's (an error it met before, e.g. resolving its backend). Cost: an
    all-gather of a 33-byte fingerprint per rank when the ranks already agree; otherwise rank
    0's values travel through all-gathers of `COPY_BYTES` per rank (every rank sends its own
    values too, which are dropped).
    """
    n = backend.world_size
    if n == 1:
        raise_agreed(failure, backend)
        return False
    digest = torch.tensor([zlib.crc32(repr(settings).encode())], dtype=torch.int64).view(torch.uint8)
    failed = torch.tensor([failure is not None], dtype=torch.uint8)
    mine = torch.cat([_fingerprint(params), digest, failed]).to(backend.device)
    rows = torch.empty(n, mine.numel(), dtype=torch.uint8, device=backend.device)
    backend.all_gather(mine, rows)
    rows = rows.cpu()
    if rows[:, -1].any():  # a rank failed (every rank may have): raised on every rank
        raise_agreed(failure, backend)
    if len({bytes(rows[r, _FINGERPRINT_BYTES:].numpy()) for r in range(n)}) > 1:
        agree_on_values(settings or {}, backend, why)  # raises on every rank, naming the setting
    layouts = {bytes(rows[r, :8].numpy()) for r in range(n)}
    if len(layouts) > 1:
        raise ValueError("the ranks' parameters differ in number, shape or dtype: every rank must build the same model")
    if len({bytes(rows[r, :_FINGERPRINT_BYTES].numpy()) for r in range(n)}) == 1:
        return False
    with torch.no_grad():
        for p in params:
            _copy_from_rank0(p, backend)
    warnings.warn(
        f"the parameters differed across the {n} ranks; every rank now holds rank 0's "
        "(start every rank from the same seed or checkpoint to avoid this copy)",
        RuntimeWarning,
        stacklevel=2,
    )
    return True


_FINGERPRINT_BYTES = 24


def _fingerprint(params: Sequence[torch.Tensor]) -> torch.Tensor:
    """_FINGERPRINT_BYTES bytes: a digest of the shapes and dtypes (the first 8), then two position-weighted sums
    of the parameters' raw bytes as int64 (wrapping, so exact and independent of the order in
    which a device adds them)."""
    layout = zlib.crc32(repr([(tuple(p.shape), str(p.dtype)) for p in params]).encode())
    device = params[0].device if params else torch.device("cpu")
    sums = torch.zeros(2, dtype=torch.int64, device=device)
    offset = 0
    for p in params:
        raw = p.detach().contiguous().view(-1).view(torch.uint8)
        for start in range(0, raw.numel(), _CHUNK):
            piece = raw[start : start + _CHUNK].to(torch.int64)
            position = torch.arange(offset + start + 1, offset + start + 1 + piece.numel(), device=device)
            for k, multiplier in enumerate(_MULTIPLIERS):
                sums[k] += (piece * (position * multiplier)).sum()
        offset += raw.numel()
    head = torch.tensor([layout], dtype=torch.int64)
    return torch.cat([head.view(torch.uint8), sums.cpu().view(torch.uint8)])


def _copy_from_rank0(p: torch.Tensor, backend: Backend) -> None:
    """p <- rank 0's p, byte for byte."""
    data = p.detach().contiguous()
    raw = data.view(-1).view(torch.uint8)
    for start in range(0, raw.numel(), COPY_BYTES):
        piece = raw[start : start + COPY_BYTES]
        rows = torch.empty(backend.world_size, piece.numel(), dtype=torch.uint8, device=piece.device)
        backend.all_gather(piece, rows)
        piece.copy_(rows[0])
    if data.data_ptr() != p.data_ptr():
        p.detach().copy_(data)

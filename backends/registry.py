"""Backends by name, and the one rule that picks a backend when the caller names none."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TypeVar

import torch

from .base import Backend
from .gloo import GlooBackend
from .hierarchical import from_torch
from .local import LocalBackend
from .mpi import MPIBackend
from .mpi_runtime import launched_by_mpi
from .nccl import NcclBackend
from .shm import ShmBackend

_REGISTRY: dict[str, Callable[..., Backend]] = {
    "local": LocalBackend,
    "gloo": GlooBackend,
    "nccl": NcclBackend,
    "mpi": MPIBackend,
    "shm": ShmBackend,
    "hierarchical": from_torch,
}
_defaults: dict[str, tuple[object, Backend]] = {}
"""By name: the default process group a default backend was built under, and the backend."""
T = TypeVar("T")


def get(name: str, **options) -> Backend:
    """A new backend by name ("gloo", "nccl", "mpi", "shm", "local", "hierarchical"); options go to
    its constructor, e.g. `group=` (a torch.distributed sub-group) or `comm=` (an MPI communicator);
    "shm" joins the ranks of one host through shared memory (`group=` of those ranks, `timeout=`);
    "hierarchical" is built from the default torch group and LOCAL_WORLD_SIZE (`local_world_size=`,
    `transport=` across nodes, `intra=` "shm", "gloo" or "nccl" inside a node; defaults as in
    `hierarchical.from_torch`)."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(_REGISTRY)} or pass a Backend")
    return _REGISTRY[name](**options)


def check_backend_argument(backend: object) -> None:
    """TypeError unless `backend` is what every `backend=` parameter takes: a name, a Backend or None."""
    if backend is not None and not isinstance(backend, (str, Backend)):
        raise TypeError(f"backend must be a name, a compcomm Backend or None, got {type(backend).__name__}")


def resolve(backend: Backend | str | None, tensor: torch.Tensor | None = None) -> Backend:
    """The backend a collective on `tensor` uses.

    An object is used as is; a name gives a cached default instance of that backend (built again
    once the default process group is made again: one over the old group could not follow it);
    None picks: an initialized torch.distributed default group (nccl for CUDA tensors, gloo for
    the rest), else MPI when launched by mpirun, else the single-process backend; but a process
    that a launcher started as one of several (WORLD_SIZE > 1) without a process group is a
    RuntimeError naming `init_process_group`, never a silent world of one.
    """
    check_backend_argument(backend)
    if isinstance(backend, Backend):
        return backend
    name = backend if backend is not None else _auto_name(tensor)
    world = torch.distributed.group.WORLD if torch.distributed.is_available() else None
    made = _defaults.get(name)
    if made is None or made[0] is not world:
        made = _defaults[name] = (world, get(name))
    return made[1]


def resolve_for_call(
    backend: Backend | str | None, tensor: torch.Tensor | None = None
) -> tuple[Backend, Exception | None]:
    """`resolve(backend, tensor)` for a collective call, and the error that `backend` raised.

    A call cannot raise such an error on its own rank: the other ranks, given a good backend,
    would wait for it in the call's agreement. So a `backend` that cannot be resolved (an
    unknown name, not a backend, one that cannot be built here) gives the backend the caller
    would have had by naming none, with the error, which the call refuses in its agreement
    over that transport: on every rank whose backend shares it (gloo or nccl over the same
    ranks). Raises only when no default can be built either."""
    if backend is None:
        return resolve(None, tensor), None
    return falling_back(lambda: resolve(backend, tensor), lambda: resolve(None, tensor))


def falling_back(chosen: Callable[[], T], default: Callable[[], T]) -> tuple[T, Exception | None]:
    """`(chosen(), None)`, or `(default(), error)` where `chosen()` raised that error (raised
    after all when `default()` fails too).

    A rank that cannot build the transport its caller chose must not raise alone: its peers
    would wait for it in their next collective. It takes the one every rank can build instead,
    and its error travels to them in the agreement over that one."""
    try:
        return chosen(), None
    except Exception as exc:
        try:
            return default(), exc
        except Exception:
            raise exc from None


def _auto_name(tensor: torch.Tensor | None) -> str:
    on_cuda = isinstance(tensor, torch.Tensor) and tensor.is_cuda
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return "nccl" if on_cuda else "gloo"
    if launched_by_mpi():
        return "mpi"
    world = os.environ.get("WORLD_SIZE", "1")
    if world.strip() not in ("", "0", "1"):
        raise RuntimeError(
            f"this process was launched as one of WORLD_SIZE={world} ranks (torchrun or similar), but "
            "torch.distributed is not initialized: call torch.distributed.init_process_group() before "
            "compcomm picks a backend (otherwise every rank would silently run as a world of one), or "
            "pass backend='local' to reduce within this process on purpose"
        )
    return "local"


def over_group(
    group: torch.distributed.ProcessGroup | None, backend: Backend | str | None, device: torch.device, what: str
) -> Backend:
    """The compcomm backend that reduces over torch `group` (None: the default group), for
    tensors on `device`: gloo (CPU) or nccl (CUDA) over the group by default or by those names;
    another name or a Backend must span the group's ranks with this rank at its place there,
    else a ValueError naming `what` the group is (e.g. "DDP's process group")."""
    check_backend_argument(backend)
    if backend is None or backend in ("gloo", "nccl"):
        return get(backend or ("nccl" if device.type == "cuda" else "gloo"), group=group)
    be = get(backend) if isinstance(backend, str) else backend
    ranks, rank = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
    if be.world_size != ranks or be.rank != rank:
        raise ValueError(
            f"the {be.name} backend does not match {what}: it spans {be.world_size} ranks, {what} {ranks} "
            f"(this rank is number {be.rank} in the backend, {rank} in the group): build the backend over "
            "that group's ranks (e.g. compcomm.backends.get('gloo', group=...)), or pass none"
        )
    return be

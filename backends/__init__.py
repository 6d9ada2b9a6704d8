"""Transports for the compressed collectives: build one by name, or let `resolve` pick.

Each backend lives in its own module and is imported only when asked for, so that optional
dependencies (mpi4py, cupy) are never needed by `import compcomm`.
"""

from __future__ import annotations

import importlib
import os

import torch

from .base import Backend
from .hierarchical import hierarchical  # binds the name to the function, not the module
from .mpi_runtime import launched_by_mpi

_REGISTRY = {
    "local": ("local", "LocalBackend"),
    "gloo": ("gloo", "GlooBackend"),
    "nccl": ("nccl", "NcclBackend"),
    "mpi": ("mpi", "MPIBackend"),
    "hierarchical": ("hierarchical", "from_torch"),
}
_defaults: dict[str, Backend] = {}

__all__ = ["Backend", "get", "hierarchical", "resolve", "launched_by_mpi"]


def get(name: str, **options) -> Backend:
    """A new backend by name ("gloo", "nccl", "mpi", "local", "hierarchical"); options go to its
    constructor, e.g. `group=` (a torch.distributed sub-group) or `comm=` (an MPI communicator);
    "hierarchical" is built from the default torch group and LOCAL_WORLD_SIZE (`local_world_size=`)."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(_REGISTRY)} or pass a Backend")
    module, cls = _REGISTRY[name]
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)(**options)


def resolve(backend: Backend | str | None, tensor: torch.Tensor | None = None) -> Backend:
    """The backend a collective on `tensor` uses.

    An object is used as is; a name gives a cached default instance of that backend; None
    picks: an initialized torch.distributed default group (nccl for CUDA tensors, gloo for
    the rest), else MPI when launched by mpirun, else the single-process backend; but a process
    that a launcher started as one of several (WORLD_SIZE > 1) without a process group is a
    RuntimeError naming `init_process_group`, never a silent world of one.
    """
    if isinstance(backend, Backend):
        return backend
    if backend is None:
        backend = _auto_name(tensor)
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a name, a compcomm Backend or None, got {type(backend).__name__}")
    if backend not in _defaults:
        _defaults[backend] = get(backend)
    return _defaults[backend]


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

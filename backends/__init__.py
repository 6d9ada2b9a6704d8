"""Transports for the compressed collectives: they move bytes and count them, never decide numerics.

One module per transport (gloo, nccl, mpi, shm (shared memory among one host's ranks), local,
and the two-level hierarchical composite);
`get(name, **options)` builds one, `resolve` picks one when the caller names none. Optional
dependencies (mpi4py, cupy) are imported only when a backend that needs them is built, so
`import compcomm` needs only torch and numpy.
"""

from .base import Backend
from .hierarchical import HierarchicalBackend, hierarchical
from .mpi_runtime import launched_by_mpi
from .registry import check_backend_argument, get, resolve

__all__ = [
    "Backend",
    "HierarchicalBackend",
    "check_backend_argument",
    "get",
    "hierarchical",
    "launched_by_mpi",
    "resolve",
]

"""compcomm: compressed (error-compensated 1-bit) collectives for PyTorch data-parallel training.

`compressed_allreduce(tensor, error_feedback)` averages (or sums) a tensor over all ranks in
place, sending one sign bit per element plus one fp32 scale per rank and chunk (~32x less than
fp32); an `ErrorFeedback` per reduced tensor carries what the 1-bit code drops into the next
call, so the sum over calls stays exact. The result is bitwise identical on every rank.

    import compcomm
    ef = compcomm.ErrorFeedback()
    compcomm.compressed_allreduce(grad, ef)              # backend=None: torch.distributed, mpirun or 1 rank
    compcomm.compressed_allreduce(grad, ef, backend=compcomm.backends.get("mpi"), op="sum")

`compressed_allreduce_coalesced(tensors, error_feedbacks)` reduces several tensors with one
agreement: all complete or none changes.

`compressed_reduce_scatter(output, tensor, error_feedback)` is the 1-bit reduce-scatter (each
rank gets its own row of the reduction).

Transports: `compcomm.backends` (gloo, nccl, mpi, local, hierarchical; `get(name, group=... / comm=...)`).
Optimizers that own the gradient communication: `compcomm.optim` (OnebitAdam, OnebitLamb, ZeroOneAdam,
and DiLoCo, which syncs every H steps). For DDP users who keep their own optimizer (SGD):
`compcomm.ddp.onebit_hook` (a DDP comm hook). For FSDP2 / HSDP models: `compcomm.fsdp.compress`.
Bucketing helpers: `compcomm.layout`. Starting local ranks: `compcomm.launch`. Which codec kernels
run here: `compcomm.codec_info()`.
Any rank's bad input raises the same error on every rank with nothing changed: TypeError,
ValueError, or `NonFiniteError` for NaN/Inf.
"""

import importlib
from types import ModuleType

from . import backends, ddp, launch, layout, optim
from .allreduce import compressed_allreduce, compressed_allreduce_coalesced
from .codec import codec_info
from .error_feedback import ErrorFeedback
from .errors import NonFiniteError
from .reduce_scatter import compressed_reduce_scatter

__all__ = [
    "compressed_allreduce",
    "compressed_allreduce_coalesced",
    "compressed_reduce_scatter",
    "ErrorFeedback",
    "NonFiniteError",
    "backends",
    "codec_info",
    "ddp",
    "fsdp",
    "launch",
    "layout",
    "optim",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> ModuleType:
    """`compcomm.fsdp` loads on first use: it imports FSDP2, which costs more than the rest of
    compcomm and which only sharded training needs."""
    if name == "fsdp":
        return importlib.import_module(".fsdp", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

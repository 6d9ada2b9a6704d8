"""compcomm: compressed (error-compensated 1-bit) collectives for PyTorch data-parallel training."""
from . import backends, layout
from .allreduce import compressed_allreduce, compressed_allreduce_coalesced
from .error_feedback import ErrorFeedback
from .errors import NonFiniteError
from . import optim  # noqa: E402  (after the collective it builds on)

__all__ = ["compressed_allreduce", "compressed_allreduce_coalesced", "ErrorFeedback", "NonFiniteError",
           "backends", "layout", "optim"]
__version__ = "0.1.0"

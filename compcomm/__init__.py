"""compcomm: compressed (error-compensated 1-bit) collectives for PyTorch data-parallel training."""
from . import backends, layout
from .allreduce import compressed_allreduce
from .error_feedback import ErrorFeedback
from .errors import NonFiniteError

__all__ = ["compressed_allreduce", "ErrorFeedback", "NonFiniteError", "backends", "layout"]
__version__ = "0.1.0"

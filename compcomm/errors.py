"""Exceptions raised identically on every rank of a failed collective."""


class NonFiniteError(FloatingPointError):
    """Some rank's input (plus its carried error) held NaN or Inf.

    Raised on every rank from the same call, before any tensor or error state changes,
    so the caller can skip the step everywhere alike.
    """

"""Bounded waits shared by the backends that poll for completion (mpi, shm)."""

from __future__ import annotations

import datetime

DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)
"""As torch.distributed's process groups."""


def timeout_seconds(timeout: float | datetime.timedelta | None) -> float:
    """`timeout` (seconds, a timedelta, or None for the default) as positive seconds."""
    if timeout is None:
        timeout = DEFAULT_TIMEOUT
    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)
    if not seconds > 0:
        raise ValueError(f"timeout must be positive (seconds or a datetime.timedelta), got {timeout!r}")
    return seconds

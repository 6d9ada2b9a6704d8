"""Peak transient memory of a call: the most it held at once beyond what existed before it.

CUDA: torch's peak-allocation counters. CPU: the kernel's peak resident set size, reset
before the call through /proc/self/clear_refs (Linux). glibc keeps freed heap memory and
would hide reuse, so large allocations must bypass the heap: `mmap_threshold_env()` gives
the environment (MALLOC_MMAP_THRESHOLD_) to start measured processes with.
"""

from __future__ import annotations

import os

import torch

MMAP_THRESHOLD = 1 << 16


def mmap_threshold_env() -> dict[str, str]:
    """Environment under which freed large allocations go straight back to the OS."""
    return {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)}


def supported(device: torch.device) -> bool:
    if device.type == "cuda":
        return True
    return (
        device.type == "cpu"
        and os.path.exists("/proc/self/clear_refs")
        and os.environ.get("MALLOC_MMAP_THRESHOLD_") == str(MMAP_THRESHOLD)
    )


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} missing from /proc/self/status")


class PeakMemory:
    """`with PeakMemory(device) as p: call()` then `p.bytes` is the call's transient peak."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.bytes: int | None = None

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        else:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM to the current resident set size
            self._base = _status_kib("VmRSS") * 1024
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.bytes = torch.cuda.max_memory_allocated(self.device) - self._base
        else:
            self.bytes = max(0, _status_kib("VmHWM") * 1024 - self._base)

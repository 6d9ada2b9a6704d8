"""Launcher of the fused CUDA kernels in compcomm/csrc/codec.cu, through cupy (the `cuda` extra).

cupy is imported, and the source compiled by NVRTC, at the first codec call on a CUDA tensor,
so `import compcomm` never needs either. Kernels run on torch's current stream of the tensor's
device, so they order with the surrounding torch work. Where cupy is missing, or set
COMPCOMM_CUDA_KERNELS=0, the codec uses its torch kernels, which give the same bits; if the
compile fails, it warns once and does the same.
"""
from __future__ import annotations

import importlib.util
import os
import warnings
from pathlib import Path
from typing import Any

import torch

THREADS = 256
MAX_BLOCKS = 1024
SOURCE = Path(__file__).with_name("csrc") / "codec.cu"

ENABLED = os.environ.get("COMPCOMM_CUDA_KERNELS", "1") != "0" and importlib.util.find_spec("cupy") is not None
"""Whether CUDA tensors go through the fused kernels; cleared if they fail to compile."""

NAMES = ("cc_worker_scan", "cc_error_update", "cc_server_scan", "cc_decode")
_kernels: dict[int, dict[str, Any]] = {}


def usable(*tensors: torch.Tensor | None) -> bool:
    """Whether the fused kernels take these tensors: all contiguous CUDA tensors, kernels on."""
    return ENABLED and all(t is None or (t.is_cuda and t.is_contiguous()) for t in tensors)


def blocks(count: int) -> int:
    """Blocks of a launch over `count` elements: one element per thread, at most MAX_BLOCKS
    (fixed by the size alone, so the partial sums always add up in the same order)."""
    return max(1, min(-(-count // THREADS), MAX_BLOCKS))


def launch(name: str, device: torch.device, count: int, *args: Any) -> bool:
    """Run kernel `name` over `count` elements on torch's current stream of `device`; False when
    the kernels cannot be had (the caller then runs its torch code). Pointers are ints (0 for
    none), scalars numpy scalars of the kernel's parameter types."""
    kernels = _compiled(device)
    if kernels is None:
        return False
    import cupy
    with cupy.cuda.Device(device.index), cupy.cuda.ExternalStream(torch.cuda.current_stream(device).cuda_stream):
        kernels[name]((blocks(count),), (THREADS,), args)
    return True


def launch_sum(name: str, device: torch.device, count: int, *args: Any) -> float | None:
    """`launch` for a kernel whose last parameter takes one float64 partial sum per block;
    returns their total (always added in the same order), or None as `launch` returns False."""
    partial = torch.empty(blocks(count), dtype=torch.float64, device=device)
    if not launch(name, device, count, *args, partial.data_ptr()):
        return None
    return float(partial.sum())


def _compiled(device: torch.device) -> dict[str, Any] | None:
    """The kernels compiled for `device`, or None (warned once) if cupy or NVRTC fails."""
    global ENABLED
    if device.index not in _kernels:
        try:
            import cupy
            with cupy.cuda.Device(device.index):
                module = cupy.RawModule(code=SOURCE.read_text())
                _kernels[device.index] = {name: module.get_function(name) for name in NAMES}
        except Exception as exc:  # noqa: BLE001 - whatever cupy/NVRTC raises, the torch kernels remain
            ENABLED = False
            warnings.warn(f"compcomm: the fused CUDA kernels are unavailable ({type(exc).__name__}: {exc}); "
                          "using the torch kernels, which give the same bits more slowly. "
                          "Set COMPCOMM_CUDA_KERNELS=0 to silence this.", RuntimeWarning, stacklevel=3)
            return None
    return _kernels[device.index]

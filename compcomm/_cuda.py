"""The fused CUDA kernels of compcomm/csrc/codec.cu, launched through cupy (the `cuda` extra).

cupy is imported, and the source compiled by NVRTC, when the codec of a CUDA device is first
chosen (compcomm.codec.codec_for), so `import compcomm` never needs either. Kernels run on
torch's current stream of the tensor's device, so they order with the surrounding torch work.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ._abi import F32, I32, I64, PTR, SIGNATURES, U32, Arg

THREADS = 256
MAX_BLOCKS = 1024
SOURCE_DIR = Path(__file__).with_name("csrc")
SCALARS: dict[str, Callable[[Any], Any]] = {PTR: int, I32: np.int32, I64: np.int64, F32: np.float32, U32: np.uint32}
"""How cupy must get each parameter kind: pointers as Python ints, scalars as sized numpy types."""


def blocks(count: int, threads: int = THREADS, max_blocks: int = MAX_BLOCKS) -> int:
    """Blocks of a launch over `count` elements: one element per thread, at most `max_blocks`
    (fixed by the size alone, so the partial sums always add up in the same order)."""
    return max(1, min(-(-count // threads), max_blocks))


class CudaKernels:
    """The CUDA kernels compiled for one device, on contiguous CUDA tensors. Building one
    compiles the source; it raises whatever cupy or NVRTC raises when that fails."""

    description = "fused CUDA kernels (cupy, NVRTC)"

    def __init__(self, device: torch.device) -> None:
        import cupy

        self.index = device.index if device.index is not None else torch.cuda.current_device()
        with cupy.cuda.Device(self.index):
            module = cupy.RawModule(code=(SOURCE_DIR / "codec.cu").read_text(), options=(f"-I{SOURCE_DIR}",))
            self.functions: dict[str, Any] = {name: module.get_function(name) for name in SIGNATURES}

    def accepts(self, tensors: Iterable[torch.Tensor | None]) -> bool:
        return all(t is None or (t.is_cuda and t.is_contiguous()) for t in tensors)

    def blocks(self, count: int) -> int:
        return blocks(count)

    def launch(self, kernel: str, device: torch.device, count: int, args: Sequence[Arg]) -> None:
        import cupy

        typed = tuple(SCALARS[kind](a) for kind, a in zip(SIGNATURES[kernel], args))
        stream = torch.cuda.current_stream(device).cuda_stream
        with cupy.cuda.Device(self.index), cupy.cuda.ExternalStream(stream):
            self.functions[kernel]((blocks(count),), (THREADS,), typed)

"""The CUDA kernels of compcomm/csrc/codec.cu, run on the CPU (see cuda_emulation.cpp).

`EmulatedCudaKernels(lib)` is a kernel set (compcomm._abi.Kernels) that takes contiguous CPU
tensors and runs the CUDA kernel source on them, so a `Codec` built on it runs the codec's own
argument lists and the kernels themselves; only what a GPU alone has goes untested.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from compcomm import _cuda, _native

SOURCE = Path(__file__).with_name("cuda_emulation.cpp")
# Small launches, so that grid-stride loops, several blocks and idle warps all occur.
THREADS, MAX_BLOCKS = 64, 3


def compiler_missing() -> str | None:
    """Why the emulator cannot be built here, or None."""
    return None if shutil.which("g++") else "g++ is not installed (the CUDA emulator is C++20)"


def build(directory: Path) -> ctypes.CDLL:
    target = directory / "cuda_emulation.so"
    subprocess.run(
        [
            "g++",
            "-std=c++20",
            "-O1",
            "-Wall",
            "-Wextra",
            "-pthread",
            "-shared",
            "-fPIC",
            str(SOURCE),
            "-o",
            str(target),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    lib = ctypes.CDLL(str(target))
    _native.bind(lib, prefix=(ctypes.c_uint, ctypes.c_uint), rename="emulate_")
    return lib


class EmulatedCudaKernels:
    """The CUDA kernels on contiguous CPU tensors, launched as `THREADS` x `blocks(count)`."""

    description = "CUDA kernels emulated on the CPU (tests)"

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib

    def accepts(self, tensors: Iterable[torch.Tensor | None]) -> bool:
        return all(t is None or (t.device.type == "cpu" and t.is_contiguous()) for t in tensors)

    def blocks(self, count: int) -> int:
        return _cuda.blocks(count, THREADS, MAX_BLOCKS)

    def launch(self, kernel: str, device: torch.device, count: int, args: Sequence[int | float]) -> None:
        getattr(self.lib, kernel.replace("cc_", "emulate_"))(self.blocks(count), THREADS, *args)

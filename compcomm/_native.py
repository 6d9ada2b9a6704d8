"""The fused C kernels of compcomm/csrc/codec.c, loaded with ctypes when they were built.

The library is an ordinary shared object that setuptools builds next to this file; ctypes
releases the GIL for each call, so the codec runs while collectives are in flight.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from ._abi import F32, I32, I64, PTR, SIGNATURES, U32, Arg

CTYPES = {PTR: ctypes.c_void_p, I32: ctypes.c_int, I64: ctypes.c_longlong, F32: ctypes.c_float, U32: ctypes.c_uint}
LIBRARY = "_codec_native"


def bind(lib: ctypes.CDLL, prefix: tuple[type, ...] = (), rename: str = "cc_") -> None:
    """Set the ctypes signature of every kernel of `lib` from the ABI table (named `rename`
    + the kernel's name without `cc_`, with `prefix` parameters first)."""
    for name, params in SIGNATURES.items():
        fn = getattr(lib, rename + name[len("cc_") :])
        fn.restype, fn.argtypes = None, [*prefix, *(CTYPES[p] for p in params)]


def library_path() -> str | None:
    """The built C library next to this file, or None when the install could not compile it."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = Path(__file__).with_name(LIBRARY + suffix)
        if path.exists():
            return str(path)
    return None


class NativeKernels:
    """The C kernels, on contiguous CPU tensors; one block each (one partial sum)."""

    def __init__(self, path: str) -> None:
        self.lib = ctypes.CDLL(path)
        bind(self.lib)
        self.lib.cc_cpu_features.restype, self.lib.cc_cpu_features.argtypes = ctypes.c_int, []
        self.avx2 = bool(self.lib.cc_cpu_features() & 1)
        self.description = "native C kernels " + ("(AVX2 + FMA)" if self.avx2 else "(portable, no AVX2 on this CPU)")

    def accepts(self, tensors: Iterable[torch.Tensor | None]) -> bool:
        return all(t is None or (t.device.type == "cpu" and t.is_contiguous()) for t in tensors)

    def blocks(self, count: int) -> int:
        return 1

    def launch(self, kernel: str, device: torch.device, count: int, args: Sequence[Arg]) -> None:
        getattr(self.lib, kernel)(*args)

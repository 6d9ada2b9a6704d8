"""The CUDA kernels of compcomm/csrc/codec.cu, run on the CPU (see cuda_emulation.cpp).

`emulated_cuda(lib)` routes the codec's CUDA dispatch (`compcomm._cuda`) to the emulator for
CPU tensors, so a test runs codec.py's own launch code, argument for argument, and the kernel
source itself; only what a GPU alone has goes untested.
"""
from __future__ import annotations

import contextlib
import ctypes
import shutil
import subprocess
from pathlib import Path

from compcomm import _cuda, _native

SOURCE = Path(__file__).with_name("cuda_emulation.cpp")
_P, _I, _LL, _F, _U = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong, ctypes.c_float, ctypes.c_uint
_ARGTYPES = {
    "cc_worker_scan": [_P, _I, _LL, _P, _LL, _P, _P],
    "cc_error_update": [_P, _I, _LL, _P, _LL, _LL, _F],
    "cc_server_scan": [_P, _LL, _I, _P, _F, _P, _LL, _LL, _P, _P],
    "cc_decode": [_P, _LL, _I, _U, _U, _P],
}
# Small launches, so that grid-stride loops, several blocks and idle warps all occur.
THREADS, MAX_BLOCKS = 64, 3


def compiler_missing() -> str | None:
    """Why the emulator cannot be built here, or None."""
    return None if shutil.which("g++") else "g++ is not installed (the CUDA emulator is C++20)"


def build(directory: Path) -> ctypes.CDLL:
    target = directory / "cuda_emulation.so"
    subprocess.run(["g++", "-std=c++20", "-O1", "-pthread", "-shared", "-fPIC", str(SOURCE), "-o", str(target)],
                   check=True, capture_output=True, text=True)
    lib = ctypes.CDLL(str(target))
    for name, argtypes in _ARGTYPES.items():
        fn = getattr(lib, name.replace("cc_", "emulate_"))
        fn.restype, fn.argtypes = None, [ctypes.c_uint, ctypes.c_uint] + argtypes
    return lib


@contextlib.contextmanager
def emulated_cuda(lib: ctypes.CDLL):
    """Within: the codec takes contiguous CPU tensors for CUDA ones and launches the emulator."""
    def launch(name, device, count, *args):
        getattr(lib, name.replace("cc_", "emulate_"))(_cuda.blocks(count), _cuda.THREADS,
                                                      *(a.item() if hasattr(a, "item") else a for a in args))
        return True

    saved = _native.LIB, _cuda.usable, _cuda.launch, _cuda.THREADS, _cuda.MAX_BLOCKS
    _native.LIB = None
    _cuda.usable = lambda *tensors: all(t is None or t.is_contiguous() for t in tensors)
    _cuda.launch, _cuda.THREADS, _cuda.MAX_BLOCKS = launch, THREADS, MAX_BLOCKS
    try:
        yield
    finally:
        _native.LIB, _cuda.usable, _cuda.launch, _cuda.THREADS, _cuda.MAX_BLOCKS = saved

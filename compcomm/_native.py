"""The fused C kernels of compcomm/csrc/codec.c, loaded with ctypes when they were built.

The library is an ordinary shared object that setuptools builds next to this file; ctypes
releases the GIL for each call, so the codec runs while collectives are in flight.

Two settings, each giving the same bits whatever its value:

- the kernel set: the best this CPU has (AVX-512, else AVX2 + FMA, else portable C), or at
  most the one named by COMPCOMM_NATIVE_ISA (`avx512`, `avx2`, `portable`);
- threads per pass: COMPCOMM_CODEC_THREADS when set, else torch.get_num_threads() at each
  call (what torch.set_num_threads and OMP_NUM_THREADS give torch's own CPU ops). A pass
  of fewer than `SPLIT_MIN` elements runs on the calling thread alone, as waking the pool
  costs more than it saves there.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from ._abi import ABI_VERSION, F32, I32, I64, PTR, SIGNATURES, U32, Arg

CTYPES = {PTR: ctypes.c_void_p, I32: ctypes.c_int, I64: ctypes.c_longlong, F32: ctypes.c_float, U32: ctypes.c_uint}
LIBRARY = "_codec_native"
ISA_ENV, THREADS_ENV = "COMPCOMM_NATIVE_ISA", "COMPCOMM_CODEC_THREADS"
AVX2, AVX512 = 1, 2
"""Bits of cc_cpu_features(): the AVX2 + FMA + F16C kernels, the AVX-512 (F, BW, VL, DQ) ones."""
ISAS = {"avx512": AVX2 | AVX512, "avx2": AVX2, "portable": 0}
"""Kernel sets a NativeKernels may be capped at, by name."""
SPLIT_MIN = 3 << 20
"""Elements from which a pass is split over threads (12 MiB of fp32), measured with the pool's
threads asleep, as they are when a pass follows communication: on 2 cores, a second thread made
passes of 8 MiB 5-15% slower and of 12-32 MiB 1.2-1.8x faster (bench/results/README.md, codec)."""

_configured: dict[str, tuple[int, int, int]] = {}
"""Per library path, the (features, threads, split_min) last passed to cc_configure."""


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


def _threads_from_env() -> int | None:
    text = os.environ.get(THREADS_ENV, "").strip()
    if not text:
        return None
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"{THREADS_ENV} must be a positive integer, got {text!r}")
    return int(text)


class StaleLibrary(RuntimeError):
    """The built C library does not match this source's kernel interface (`ABI_VERSION`)."""


class NativeKernels:
    """The C kernels, on contiguous CPU tensors; one partial sum per call (the library adds its
    blocks' sums itself, in block order).

    `isa` caps the kernel set (a name of `ISAS`; default COMPCOMM_NATIVE_ISA, else the best);
    `threads` fixes the threads per pass (default COMPCOMM_CODEC_THREADS, else
    torch.get_num_threads() at each call); `split_min` is the smallest pass split over threads.
    """

    def __init__(
        self, path: str, isa: str | None = None, threads: int | None = None, split_min: int = SPLIT_MIN
    ) -> None:
        self.path, self.lib = path, ctypes.CDLL(path)
        built = getattr(self.lib, "cc_abi_version", None)
        version = None if built is None else built()
        if version != ABI_VERSION:
            raise StaleLibrary(
                f"the C codec at {path} was built from other source (kernel interface {version}, this "
                f"compcomm needs {ABI_VERSION}): rebuild it (pip install -e . in the checkout)"
            )
        bind(self.lib)
        self.lib.cc_cpu_features.restype, self.lib.cc_cpu_features.argtypes = ctypes.c_int, []
        self.lib.cc_features.restype, self.lib.cc_features.argtypes = ctypes.c_int, []
        self.lib.cc_configure.restype = None
        self.lib.cc_configure.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_longlong]
        capped = isa is not None or bool(os.environ.get(ISA_ENV))
        name = isa if isa is not None else os.environ.get(ISA_ENV, "avx512") or "avx512"
        if name not in ISAS:
            raise ValueError(f"unknown kernel set {name!r} ({ISA_ENV}): one of {', '.join(ISAS)}")
        self.features = ISAS[name] & self.lib.cc_cpu_features()
        self.threads = threads if threads is not None else _threads_from_env()
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be at least 1, got {self.threads}")
        self.split_min = split_min
        self.avx512, self.avx2 = bool(self.features & AVX512), bool(self.features & AVX2)
        kernels = "AVX-512" if self.avx512 else "AVX2 + FMA" if self.avx2 else "portable"
        if capped and self.features != self.lib.cc_cpu_features():
            kernels += f", capped by {ISA_ENV}" if isa is None else f", capped at {name}"
        elif not self.avx2:
            kernels += ", no AVX2 on this CPU"
        self._kernels_named = kernels

    @property
    def description(self) -> str:
        """What runs, in words; without a fixed thread count, the passes take torch's at each
        call, so this says how many that is now."""
        if self.threads is not None:
            on = f"{self.threads} threads"
        else:
            on = f"{torch.get_num_threads()} thread(s) (torch.get_num_threads(), read at each call)"
        return f"native C kernels ({self._kernels_named}) on {on}"

    def accepts(self, tensors: Iterable[torch.Tensor | None]) -> bool:
        return all(t is None or (t.is_cpu and t.is_contiguous()) for t in tensors)

    def blocks(self, count: int) -> int:
        return 1

    def launch(self, kernel: str, device: torch.device, count: int, args: Sequence[Arg]) -> None:
        config = (self.features, self.threads or torch.get_num_threads(), self.split_min)
        if _configured.get(self.path) != config:  # settings of the library, shared by its instances
            self.lib.cc_configure(*config)
            _configured[self.path] = config
        getattr(self.lib, kernel)(*args)

"""ctypes binding of the fused C kernels in compcomm/csrc/codec.c, when they were built.

The library is an ordinary shared object built by setuptools next to this file; ctypes
releases the GIL for each call, so the codec runs while collectives are in flight. Set
COMPCOMM_NATIVE=0 to force the pure-torch kernels, which give the same bits.
"""
from __future__ import annotations

import ctypes
import importlib.util
import os

_P, _I64, _INT, _F32, _F64, _U32 = (ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float,
                                    ctypes.c_double, ctypes.c_uint32)
_SIGNATURES = {
    "cc_worker_scan": (_F64, [_P, _INT, _I64, _P, _I64, _P]),
    "cc_error_update": (None, [_P, _INT, _I64, _P, _I64, _I64, _F32]),
    "cc_server_scan": (_F64, [_P, _I64, _INT, _P, _F32, _P, _I64, _I64, _P]),
    "cc_decode": (None, [_P, _I64, _INT, _U32, _U32, _P]),
}


def _load() -> ctypes.CDLL | None:
    if os.environ.get("COMPCOMM_NATIVE", "1") == "0":
        return None
    spec = importlib.util.find_spec("compcomm._codec_native")
    if spec is None or not spec.origin or not os.path.exists(spec.origin):
        return None
    lib = ctypes.CDLL(spec.origin)
    for name, (restype, argtypes) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib


LIB = _load()

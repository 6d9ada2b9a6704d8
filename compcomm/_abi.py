"""The codec's kernel ABI on the Python side, mirroring compcomm/csrc/codec_abi.h.

A kernel name means the same parameters in C and CUDA, so one table serves every kernel set
(the C library through ctypes, the CUDA kernels through cupy, the tests' CPU emulation of the
CUDA ones). tests/test_codec.py checks this table against the header.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

import torch

PTR, I32, I64, F32, U32 = "ptr", "int", "cc_index", "float", "unsigned int"

ABI_VERSION = 3
"""CC_ABI_VERSION of the C library this table describes (`cc_abi_version()`)."""

DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
"""enum cc_dtype: CC_F32, CC_F16, CC_BF16."""

SIGNATURES: dict[str, tuple[str, ...]] = {
    "cc_worker_scan": (PTR, I32, I64, PTR, F32, PTR, F32, I32, I64, PTR, PTR, PTR),
    "cc_error_update": (PTR, I32, I64, PTR, PTR, I64, I64, F32, PTR),
    "cc_server_scan": (PTR, I64, I32, PTR, F32, PTR, PTR, I64, I64, PTR, PTR),
    "cc_decode": (PTR, I64, I32, U32, U32, PTR),
}
"""Parameter kinds of each kernel, in order. A kernel that sums (or, the error update, takes the
largest) writes per-block results into its last parameter, `partial`."""

Arg = int | float


class Kernels(Protocol):
    """A set of the four fused kernels on one kind of device.

    `accepts` says whether the kernels can take these tensors (else the codec runs its torch
    code); `blocks(count)` is how many float64 partial sums a summing kernel over `count`
    elements writes; `launch` runs one kernel, pointers as ints (0 for null).
    """

    @property
    def description(self) -> str: ...

    def accepts(self, tensors: Iterable[torch.Tensor | None]) -> bool: ...

    def blocks(self, count: int) -> int: ...

    def launch(self, kernel: str, device: torch.device, count: int, args: Sequence[Arg]) -> None: ...

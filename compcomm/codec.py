"""The 1-bit sign/scale codec: every pass over tensor-sized memory lives here.

A value v is coded as one bit, 1 for sign(v) = +1 (v >= 0, so -0.0 too) and 0 for -1, packed
MSB-first into bytes, plus one fp32 scale per rank and chunk. The passes, in call order:

- `worker_scan`: v = x + e_w; bits = sign(v); returns sum(v[:N]^2). Writes only the bits,
  so the call can still be rejected afterwards with nothing changed.
- `error_update_`: e <- v - s sign(v) on the real elements, 0 on padding (worker and server).
- `server_scan_`: y = (1/n) sum_r s_r sign_r + e_s, stored in e_s; bits = sign(y); sum(y^2).
- `decode`: out = t sign, written in the output dtype.

Each pass runs as one fused kernel: C on contiguous CPU tensors (`_native`), CUDA through
cupy on contiguous CUDA tensors (`_cuda`), and otherwise as block-wise torch code (any
device) whose temporaries stay a few MiB. All do the same fp32 operations in the same order
and give the same bits; scales are summed in float64 so that every device rounds them to the
same fp32 value.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from . import _cuda, _native

_BLOCK = {"cpu": 1 << 18}
_DEFAULT_BLOCK = 1 << 24
_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_BIT_WEIGHTS: dict[torch.device, torch.Tensor] = {}


def native_available() -> bool:
    """Whether the fused C kernels were built and loaded."""
    return _native.LIB is not None


def _native_ok(*tensors: torch.Tensor | None) -> bool:
    return _native.LIB is not None and all(
        t is None or (t.device.type == "cpu" and t.is_contiguous()) for t in tensors)


def block_size(device: torch.device) -> int:
    """Elements per block of the torch kernels: small on CPU (cache), large elsewhere."""
    return _BLOCK.get(device.type, _DEFAULT_BLOCK)


def rms_scale(sum_sq: float, count: int) -> float:
    """sqrt(sum_sq / count), rounded to fp32 (0 when count is 0)."""
    if count == 0:
        return 0.0
    return float(np.float32(math.sqrt(sum_sq / count)))


def pack_signs(values: torch.Tensor, out: torch.Tensor) -> None:
    """out (len/8 bytes) <- MSB-first bits of values >= 0 (length a multiple of 8)."""
    mask = values >= 0
    if mask.device.type == "cpu":
        out.copy_(torch.from_numpy(np.packbits(mask.numpy())))
        return
    if mask.device not in _BIT_WEIGHTS:
        _BIT_WEIGHTS[mask.device] = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8,
                                                 device=mask.device)
    out.copy_((mask.view(-1, 8).to(torch.uint8) * _BIT_WEIGHTS[mask.device]).sum(1, dtype=torch.uint8))


def sign_table(plus: torch.Tensor, minus: torch.Tensor) -> torch.Tensor:
    """(256, 8) table: row b holds the eight values coded by byte b, MSB first."""
    bits = torch.from_numpy(np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1)).bool()
    return torch.where(bits.to(plus.device), plus, minus)


def worker_scan(x: torch.Tensor, error: torch.Tensor | None, bits: torch.Tensor) -> float:
    """bits <- sign(v) for v = pad(x) + error over the padded length 8 * len(bits);
    returns sum(v[:len(x)]^2) in float64. `error` may be None (zeros)."""
    m = 8 * bits.numel()
    if _native_ok(x, error, bits):
        return _native.LIB.cc_worker_scan(x.data_ptr(), _DTYPE_CODES[x.dtype], x.numel(),
                                          None if error is None else error.data_ptr(), m, bits.data_ptr())
    if _cuda.usable(x, error, bits):
        total = _cuda.launch_sum("cc_worker_scan", bits.device, m, x.data_ptr(), np.int32(_DTYPE_CODES[x.dtype]),
                                 np.int64(x.numel()), 0 if error is None else error.data_ptr(), np.int64(m),
                                 bits.data_ptr())
        if total is not None:
            return total
    total = torch.zeros((), dtype=torch.float64, device=bits.device)
    step, n = block_size(bits.device), x.numel()
    for start in range(0, m, step):
        stop = min(start + step, m)
        v = torch.zeros(stop - start, dtype=torch.float32, device=bits.device)
        live = max(0, min(n, stop) - start)
        v[:live] = x[start:start + live]
        if error is not None:
            v += error[start:stop]
        head = v[:live].double()
        total += torch.dot(head, head)
        pack_signs(v, bits[start // 8:stop // 8])
    return float(total)


def error_update_(error: torch.Tensor, scale: float, real: int, x: torch.Tensor | None = None) -> None:
    """error <- v - scale * sign(v) with v = error (+ x on x's length) on [:real], 0 beyond."""
    if _native_ok(x, error):
        _native.LIB.cc_error_update(None if x is None else x.data_ptr(), 0 if x is None else _DTYPE_CODES[x.dtype],
                                    0 if x is None else x.numel(), error.data_ptr(), real, error.numel(), scale)
        return
    if _cuda.usable(x, error) and _cuda.launch(
            "cc_error_update", error.device, error.numel(), 0 if x is None else x.data_ptr(),
            np.int32(0 if x is None else _DTYPE_CODES[x.dtype]), np.int64(0 if x is None else min(x.numel(), real)),
            error.data_ptr(), np.int64(real), np.int64(error.numel()), np.float32(scale)):
        return
    plus = torch.tensor(scale, dtype=torch.float32, device=error.device)
    minus, step = -plus, block_size(error.device)
    n = 0 if x is None else x.numel()
    for start in range(0, real, step):
        v = error[start:min(start + step, real)]
        live = max(0, min(n, start + v.numel()) - start)
        if live:
            v[:live] += x[start:start + live]
        v -= torch.where(v >= 0, plus, minus)
    error[real:].zero_()


def server_scan_(bits: torch.Tensor, scales: torch.Tensor, divisor: int, error: torch.Tensor, real: int,
                 out_bits: torch.Tensor) -> float:
    """error <- y = (sum_r scales[r] sign_r) / divisor + error, summed in rank order, where row r
    of `bits` (n, C/8) holds rank r's signs of this chunk; out_bits <- sign(y).
    Returns sum(y[:real]^2) in float64."""
    n, c = bits.shape[0], error.numel()
    if _native_ok(bits, scales, error, out_bits):
        return _native.LIB.cc_server_scan(bits.data_ptr(), bits.stride(0), n, scales.data_ptr(), float(divisor),
                                          error.data_ptr(), c, real, out_bits.data_ptr())
    if _cuda.usable(bits, scales, error, out_bits):
        total = _cuda.launch_sum("cc_server_scan", error.device, c, bits.data_ptr(), np.int64(bits.stride(0)),
                                 np.int32(n), scales.data_ptr(), np.float32(divisor), error.data_ptr(), np.int64(c),
                                 np.int64(real), out_bits.data_ptr())
        if total is not None:
            return total
    tables = [sign_table(s, -s) for s in scales]
    total = torch.zeros((), dtype=torch.float64, device=error.device)
    step = block_size(error.device)
    for start in range(0, c, step):
        stop = min(start + step, c)
        a = tables[0][bits[0, start // 8:stop // 8].long()].view(-1)
        for r in range(1, n):
            a += tables[r][bits[r, start // 8:stop // 8].long()].view(-1)
        if divisor != 1:  # by a tensor: CUDA would multiply by 1/divisor for a Python number
            a /= torch.tensor(float(divisor), device=a.device)
        y = error[start:stop]
        y += a
        head = y[:max(0, min(real, stop) - start)].double()
        total += torch.dot(head, head)
        pack_signs(y, out_bits[start // 8:stop // 8])
    return float(total)


def decode(bits: torch.Tensor, scale: float, out: torch.Tensor) -> None:
    """out (float dtype, len <= 8 * len(bits)) <- scale * sign coded by `bits`."""
    values = torch.tensor([scale, -scale], dtype=torch.float32).to(out.dtype)
    plus, minus = (v & ((1 << (8 * out.element_size())) - 1)
                   for v in values.view(torch.int32 if out.element_size() == 4 else torch.int16).tolist())
    if _native_ok(bits, out):
        _native.LIB.cc_decode(bits.data_ptr(), out.numel(), out.element_size(), plus, minus, out.data_ptr())
        return
    if _cuda.usable(bits, out) and _cuda.launch(
            "cc_decode", out.device, out.numel(), bits.data_ptr(), np.int64(out.numel()),
            np.int32(out.element_size()), np.uint32(plus), np.uint32(minus), out.data_ptr()):
        return
    table = sign_table(values[0].to(out.device), values[1].to(out.device))
    step, whole = block_size(out.device), out.numel() // 8 * 8
    for start in range(0, whole, step):
        stop = min(start + step, whole)
        out[start:stop].copy_(table[bits[start // 8:stop // 8].long()].view(-1))
    if whole < out.numel():
        out[whole:].copy_(table[bits[whole // 8].long()][:out.numel() - whole])

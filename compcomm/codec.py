"""The 1-bit sign/scale codec: every pass over tensor-sized memory lives here.

A value v is coded as one bit, 1 for sign(v) = +1 (v >= 0, so -0.0 too) and 0 for -1, packed
MSB-first into bytes, plus one fp32 scale per rank and chunk. The kernels work block by block
so that temporaries stay small (a few MiB whatever the tensor size) and cache-resident on CPU.
They are device-agnostic torch code; on CPU the bit packing goes through numpy's SIMD packbits.
Scales are accumulated in float64 so that every device rounds them to the same fp32 value.
"""
from __future__ import annotations

import math

import numpy as np
import torch

_BLOCK = {"cpu": 1 << 18}
_DEFAULT_BLOCK = 1 << 24
_BIT_WEIGHTS: dict[torch.device, torch.Tensor] = {}
_SIGN_TABLES: dict[torch.device, torch.Tensor] = {}


def block_size(device: torch.device) -> int:
    """Elements per block: small on CPU (cache), large on accelerators (launch overhead)."""
    return _BLOCK.get(device.type, _DEFAULT_BLOCK)


def _bit_weights(device: torch.device) -> torch.Tensor:
    if device not in _BIT_WEIGHTS:
        _BIT_WEIGHTS[device] = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8,
                                            device=device)
    return _BIT_WEIGHTS[device]


def sign_table(device: torch.device) -> torch.Tensor:
    """(256, 8) fp32 table: row b holds the eight +-1 signs coded by byte b, MSB first."""
    if device not in _SIGN_TABLES:
        bits = np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1)
        _SIGN_TABLES[device] = torch.from_numpy(bits.astype(np.float32) * 2 - 1).to(device)
    return _SIGN_TABLES[device]


def pack_signs(mask: torch.Tensor, out: torch.Tensor) -> None:
    """Pack a boolean mask (length a multiple of 8) into `out` bytes, MSB first."""
    if mask.device.type == "cpu":
        out.copy_(torch.from_numpy(np.packbits(mask.numpy())))
    else:
        out.copy_((mask.view(-1, 8).to(torch.uint8) * _bit_weights(mask.device)).sum(1, dtype=torch.uint8))


def unpack_scaled(bits: torch.Tensor, scale: torch.Tensor, out: torch.Tensor, accumulate: bool = False) -> None:
    """out (8 * len(bits) fp32) = (or +=) scale * sign coded by `bits`."""
    table = sign_table(bits.device) * scale
    values = table[bits.long()].view(-1)
    if accumulate:
        out.add_(values)
    else:
        out.copy_(values)


def sum_squares(x: torch.Tensor, addend: torch.Tensor | None = None) -> float:
    """sum((x + addend)^2) over x's length, in float64, without materializing x + addend."""
    total = torch.zeros((), dtype=torch.float64, device=x.device)
    step = block_size(x.device)
    for start in range(0, x.numel(), step):
        block = x[start:start + step].to(torch.float32)
        if addend is not None:
            block = block + addend[start:start + block.numel()]
        block = block.double()
        total += torch.dot(block, block)
    return float(total)


def rms_scale(sum_sq: float, count: int) -> float:
    """||v||_2 / sqrt(count), rounded to fp32 (0 when count is 0)."""
    if count == 0:
        return 0.0
    return float(np.float32(math.sqrt(sum_sq / count)))


def compress_(error: torch.Tensor, scale: float, bits: torch.Tensor, real: int,
              addend: torch.Tensor | None = None) -> None:
    """Error-feedback compression in place: with v = error + addend (fp32; addend covers a
    prefix of error), write bits = packbits(v >= 0) and error <- v - scale * sign(v) on
    [:real], 0 beyond.
    """
    step = block_size(error.device)
    plus = torch.tensor(scale, dtype=torch.float32, device=error.device)
    minus = -plus
    for start in range(0, error.numel(), step):
        block = error[start:start + step]
        if addend is not None and start < addend.numel():
            part = addend[start:start + block.numel()]
            block[:part.numel()] += part
        mask = block >= 0
        pack_signs(mask, bits[start // 8:(start + block.numel()) // 8])
        block -= torch.where(mask, plus, minus)
    error[real:].zero_()


def server_reduce_(bits: torch.Tensor, scales: torch.Tensor, divisor: int, error: torch.Tensor,
                   real: int) -> float:
    """Server step 1: error <- (1/divisor) * sum_r scales[r] * sign_r + error, where row r of
    `bits` (n, C/8) holds rank r's signs for this chunk, summed in rank order.
    Returns sum(y[:real]^2) in float64 for the server scale.
    """
    step = block_size(error.device)
    acc = torch.empty(min(step, error.numel()), dtype=torch.float32, device=error.device)
    total = torch.zeros((), dtype=torch.float64, device=error.device)
    for start in range(0, error.numel(), step):
        stop = min(start + step, error.numel())
        a = acc[:stop - start]
        for r in range(bits.shape[0]):
            unpack_scaled(bits[r, start // 8:stop // 8], scales[r], a, accumulate=r > 0)
        if divisor != 1:
            a /= divisor
        y = error[start:stop]
        y += a
        head = y[:max(0, min(real, stop) - start)].double()
        total += torch.dot(head, head)
    return float(total)


def decode(bits: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> None:
    """out (any float dtype, len <= 8 * len(bits)) <- scale * sign coded by `bits`."""
    step = block_size(out.device)
    buf = torch.empty(min(step, 8 * bits.numel()), dtype=torch.float32, device=out.device)
    for start in range(0, out.numel(), step):
        stop = min(start + step, out.numel())
        padded_stop = -(-stop // 8) * 8
        values = buf[:padded_stop - start]
        unpack_scaled(bits[start // 8:padded_stop // 8], scale, values)
        out[start:stop].copy_(values[:stop - start])

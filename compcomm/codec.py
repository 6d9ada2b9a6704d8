"""The 1-bit sign/scale codec: every pass over tensor-sized memory lives here.

A value v is coded as one bit, 1 for sign(v) = +1 (v >= 0, so -0.0 too) and 0 for -1, packed
MSB-first into bytes, plus one fp32 scale per rank and chunk. A `Codec` has four passes, which
the allreduce calls in this order:

- `worker_scan`: v = x + e_w; bits = sign(v); returns sum(v[:N]^2). e_w may be held in the x'
  form (the previous call's v and scale s: e_w = v - s sign(v) on [:N], 0 beyond, computed on
  the fly), and v may be written to a buffer apart from the error state: the next x', which
  spares the worker its `error_update_`. Writes nothing else, so the call can still be
  rejected afterwards with nothing changed.
- `error_update_`: e <- v - s sign(v) on the real elements, 0 on padding (worker and server),
  in place or into another buffer; on request it returns max |e|, the server error's bound in
  the next call's phase 0, measured as it is written rather than by a pass of its own.
- `server_scan_`: y = (1/n) sum_r s_r sign_r + e_s, stored in e_s (or read from another buffer:
  `previous`); bits = sign(y); sum(y^2).
- `decode`: out = t sign, written in the output dtype.

Each pass runs as one fused kernel when the codec's kernel set takes the tensors (C on
contiguous CPU tensors, on several threads for large passes; CUDA through cupy on contiguous
CUDA tensors; see `codec_info()`), and otherwise as block-wise torch code (any device) whose
temporaries stay a few MiB. All do the same fp32 operations in the same order and give the same
bits; scales are summed in float64 so that every device rounds them to the same fp32 value. `codec_for(device)` chooses
the kernels once per device; a test builds `Codec(kernels)` with the set it wants.

The seam for another code (2-bit, 8-bit, top-k): backends only move the uint8 buffers these
passes fill, so they need no change. A second codec class with the same four passes (its
`worker_scan` writing its own wire bytes per chunk instead of C/8 sign bytes, `decode` reading
them) plus the byte count per chunk is what the allreduce's schedule would take as a parameter
where it sizes its buffers today (`chunk_size // 8`); the phases, the error feedback and the
phase-0 agreement stay as they are.
"""

from __future__ import annotations

import ctypes
import importlib.util
import math
import os
import warnings
from collections.abc import Callable, Sequence

import numpy as np
import torch

from . import _cuda, _native
from ._abi import DTYPE_CODES, Arg, Kernels
from .errors import largest_magnitude

_BLOCK = {"cpu": 1 << 18}
_DEFAULT_BLOCK = 1 << 24
_BIT_WEIGHTS: dict[torch.device, torch.Tensor] = {}
_FALLBACK_SLOWDOWN = "about 10x slower per call on CPU"


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
        _BIT_WEIGHTS[mask.device] = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8, device=mask.device)
    out.copy_((mask.view(-1, 8).to(torch.uint8) * _BIT_WEIGHTS[mask.device]).sum(1, dtype=torch.uint8))


def sign_table(plus: torch.Tensor, minus: torch.Tensor) -> torch.Tensor:
    """(256, 8) table: row b holds the eight values coded by byte b, MSB first."""
    bits = torch.from_numpy(np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1)).bool()
    return torch.where(bits.to(plus.device), plus, minus)


def sign_patterns(scale: float, dtype: torch.dtype) -> tuple[int, int]:
    """The bit patterns of +scale and -scale in `dtype` (float32, float16 or bfloat16), as
    torch.tensor([scale, -scale], dtype=torch.float32).to(dtype) holds them for any scale but
    NaN (which no accepted call decodes): rounded to fp32, then to `dtype`, each to nearest
    even, inf beyond the range (numpy has no bfloat16: that rounding is done on the fp32 bits).
    A few microseconds cheaper per decode than building the tensors."""
    with np.errstate(over="ignore"):
        values = np.array([scale, -scale], dtype=np.float32)
        half = values.astype(np.float16) if dtype == torch.float16 else None
    if dtype == torch.float32:
        plus, minus = values.view(np.uint32).tolist()
    elif half is not None:
        plus, minus = half.view(np.uint16).tolist()
    elif dtype == torch.bfloat16:
        plus, minus = (_bf16_bits(v) for v in values.view(np.uint32).tolist())
    else:
        raise TypeError(f"decode: no float32/float16/bfloat16 output but {dtype}")
    return plus, minus


def _bf16_bits(f32: int) -> int:
    """The bfloat16 nearest (ties to even) the fp32 with bits `f32`; a NaN stays a NaN."""
    if f32 & 0x7FFFFFFF > 0x7F800000:
        return (f32 >> 16) | 0x0040
    return (f32 + 0x7FFF + ((f32 >> 16) & 1)) >> 16


def divide_(t: torch.Tensor, divisor: float) -> torch.Tensor:
    """t /= divisor, a true division in at least fp32 on every device, as the fused kernels and
    the CPU compute it: torch on CUDA multiplies by 1/divisor when the divisor is a Python
    number (or a CPU scalar), one ulp off in about a third of the elements for a divisor of 3,
    so it divides by a 0-dim tensor on t's device; and a 0-dim divisor off the CPU takes t's
    dtype, so a half-precision t there is divided in fp32 and rounded once (in fp16, 2049 would
    become 2048; the CPU reads a CPU divisor in fp32 itself). Returns t."""
    if divisor == 1:
        return t
    wide = torch.promote_types(t.dtype, torch.float32)
    by = torch.tensor(float(divisor), dtype=wide, device=t.device)
    if t.dtype == wide or t.device.type == "cpu":
        return t.div_(by)
    return t.copy_(t.to(wide).div_(by))


def storages(*tensors: torch.Tensor | None) -> set[int]:
    """The allocations these tensors view, by address: two tensors share memory when their sets
    meet. Empty allocations count as none (their addresses may all be 0)."""
    return {t.untyped_storage().data_ptr() for t in tensors if t is not None and t.untyped_storage().nbytes()}


def _shares_storage(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return bool(storages(a) & storages(b))


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


class Codec:
    """The four passes, on fused `kernels` where they take the tensors, else in torch code.

    `kernels=None` is the torch code alone; `why` says in words what runs and why (see
    `codec_info()`).
    """

    def __init__(self, kernels: Kernels | None = None, why: str = "") -> None:
        self.kernels = kernels
        self._why = why

    @property
    def why(self) -> str:
        return self._why or (self.kernels.description if self.kernels is not None else "torch kernels")

    def _fused(
        self, kernel: str, device: torch.device, count: int, tensors: Sequence[torch.Tensor | None], args: Sequence[Arg]
    ) -> bool:
        """Run `kernel` if the kernel set takes `tensors`; False when the torch code must."""
        if self.kernels is None or not self.kernels.accepts(tensors):
            return False
        self.kernels.launch(kernel, device, count, args)
        return True

    def _fused_reduced(
        self, kernel: str, device: torch.device, count: int, tensors: Sequence[torch.Tensor | None], args: Sequence[Arg]
    ) -> Callable[[bool], float] | None:
        """`_fused` for a kernel writing float64 per-block results (its last argument): a reader
        of them, called with `largest` for their largest (NaN if one is) or else their total
        (added in a fixed order); None when the torch code must run. A caller that ignores the
        results does not call it, and so does not wait for the device."""
        if self.kernels is None or not self.kernels.accepts(tensors):
            return None
        blocks = self.kernels.blocks(count)
        if blocks == 1 and device.type == "cpu":  # no tensor to allocate and sum: microseconds per call
            total = ctypes.c_double()
            self.kernels.launch(kernel, device, count, [*args, ctypes.addressof(total)])
            return lambda largest: total.value
        partial = torch.empty(blocks, dtype=torch.float64, device=device)
        self.kernels.launch(kernel, device, count, [*args, partial.data_ptr()])
        return lambda largest: float(partial.max() if largest else partial.sum())

    def worker_scan(
        self,
        x: torch.Tensor,
        error: torch.Tensor | None,
        bits: torch.Tensor,
        pending_scale: float | None = None,
        out: torch.Tensor | None = None,
        addend: torch.Tensor | None = None,
        divisor: float = 1.0,
    ) -> float:
        """bits <- sign(v) for v = pad(x) + e over the padded length 8 * len(bits); returns
        sum(v[:len(x)]^2) in float64. e is `error` (None: zeros), or with `pending_scale` s
        the error that `error` holds in the x' form: error - s sign(error) on x's length, 0
        beyond (the same fp32 operations as `error_update_`, so the same bits). `out` (fp32,
        sharing no memory with x, addend or error) receives v: the new x', so that this call's
        error update needs no pass of its own.

        With `addend` (fp32, x's length) or a `divisor` other than 1, x stands for
        (x + addend) / divisor, formed in fp32 as the scan reads it: a hierarchical node's sum
        and mean, which then need no passes (nor memory) of their own."""
        m, n = 8 * bits.numel(), x.numel()
        if _shares_storage(out, x) or _shares_storage(out, error) or _shares_storage(out, addend):
            raise ValueError("worker_scan: `out` must share no storage with x, the addend or the errors")
        if addend is not None and (addend.dtype != torch.float32 or addend.shape != (n,)):
            got = f"{addend.dtype} {tuple(addend.shape)}"
            raise ValueError(f"worker_scan: the addend must be {n} fp32 elements, got {got}")
        pending = pending_scale is not None and error is not None
        scale = 0.0 if pending_scale is None else pending_scale
        read = self._fused_reduced(
            "cc_worker_scan",
            bits.device,
            m,
            (x, addend, error, out, bits),
            (
                x.data_ptr(),
                DTYPE_CODES[x.dtype],
                n,
                _ptr(addend),
                divisor,
                _ptr(error),
                scale,
                int(pending),
                m,
                _ptr(out),
                bits.data_ptr(),
            ),
        )
        if read is not None:
            return read(False)
        acc = torch.zeros((), dtype=torch.float64, device=bits.device)
        step = block_size(bits.device)
        plus = torch.tensor(scale, dtype=torch.float32, device=bits.device)
        for start in range(0, m, step):
            stop = min(start + step, m)
            v = torch.zeros(stop - start, dtype=torch.float32, device=bits.device)
            live = max(0, min(n, stop) - start)
            v[:live] = x[start : start + live]
            if addend is not None:
                v[:live] += addend[start : start + live]
            divide_(v[:live], divisor)
            if pending and error is not None:
                e = error[start : start + live]
                v[:live] += e - torch.where(e >= 0, plus, -plus)
            elif error is not None:
                v += error[start:stop]
            if out is not None:
                out[start:stop] = v
            head = v[:live].double()
            acc += torch.dot(head, head)
            pack_signs(v, bits[start // 8 : stop // 8])
        return float(acc)

    def error_update_(
        self,
        error: torch.Tensor,
        scale: float,
        real: int,
        x: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
        measure: bool = False,
    ) -> float | None:
        """out <- v - scale * sign(v) with v = error (+ x on x's length) on [:real], 0 beyond.
        `out` (default: error itself) is another buffer of error's size when the caller keeps
        the old errors: the fused kernels write the new ones in one pass, with no copy of the
        old first (the torch code copies, then updates in place).

        With `measure`, returns max |out| (NaN if an element is NaN; 0 when real is 0), which
        the fused kernels find as they write; else None, without waiting for the device."""
        target = error if out is None else out
        if target is not error and _shares_storage(target, error):
            raise ValueError("error_update_: `out` must be the error tensor itself or share no storage with it")
        n = 0 if x is None else x.numel()
        read = self._fused_reduced(
            "cc_error_update",
            error.device,
            error.numel(),
            (x, error, target),
            (
                _ptr(x),
                0 if x is None else DTYPE_CODES[x.dtype],
                n,
                error.data_ptr(),
                target.data_ptr(),
                real,
                error.numel(),
                scale,
            ),
        )
        if read is not None:
            return read(True) if measure else None
        if target is not error:
            target.copy_(error)
        plus = torch.tensor(scale, dtype=torch.float32, device=error.device)
        minus, step = -plus, block_size(error.device)
        peak = 0.0
        for start in range(0, real, step):
            v = target[start : min(start + step, real)]
            live = max(0, min(n, start + v.numel()) - start)
            if live:
                assert x is not None
                v[:live] += x[start : start + live]
            v -= torch.where(v >= 0, plus, minus)
            if measure:
                block = largest_magnitude(v)
                peak = block if math.isnan(block) or block > peak else peak  # a NaN, once seen, stays
        target[real:].zero_()
        return peak if measure else None

    def server_scan_(
        self,
        bits: torch.Tensor,
        scales: torch.Tensor,
        divisor: int,
        error: torch.Tensor,
        real: int,
        out_bits: torch.Tensor,
        previous: torch.Tensor | None = None,
    ) -> float:
        """error <- y = (sum_r scales[r] sign_r) / divisor + previous, summed in rank order, where
        row r of `bits` (n, C/8; rows may lie apart, each contiguous) holds rank r's signs of
        this chunk; out_bits <- sign(y). Returns sum(y[:real]^2) in float64. `previous` (fp32, C)
        is the server error before the call: `error` itself by default (in place), or a buffer
        sharing no memory with it, which is left as it is (a call that keeps the old errors
        reads them there, instead of copying them into `error` first)."""
        n, c = bits.shape[0], error.numel()
        if previous is None:
            previous = error
        elif previous.shape != error.shape or previous.dtype != error.dtype or previous.device != error.device:
            raise ValueError("server_scan_: previous must be an fp32 tensor of error's shape, on its device")
        elif previous.data_ptr() != error.data_ptr() and _shares_storage(previous, error):
            raise ValueError("server_scan_: previous must be error itself or share no memory with it")
        # the kernel steps from row to row itself: each row must be contiguous, not the whole
        rows = bits if bits.is_contiguous() or bits.stride(-1) != 1 or not n else bits[0]
        read = self._fused_reduced(
            "cc_server_scan",
            error.device,
            c,
            (rows, scales, previous, error, out_bits),
            (
                bits.data_ptr(),
                bits.stride(0),
                n,
                scales.data_ptr(),
                float(divisor),
                previous.data_ptr(),
                error.data_ptr(),
                c,
                real,
                out_bits.data_ptr(),
            ),
        )
        if read is not None:
            return read(False)
        tables = [sign_table(s, -s) for s in scales]
        acc = torch.zeros((), dtype=torch.float64, device=error.device)
        step = block_size(error.device)
        for start in range(0, c, step):
            stop = min(start + step, c)
            a = tables[0][bits[0, start // 8 : stop // 8].long()].view(-1)
            for r in range(1, n):
                a += tables[r][bits[r, start // 8 : stop // 8].long()].view(-1)
            divide_(a, divisor)
            y = error[start:stop]
            torch.add(previous[start:stop], a, out=y)
            head = y[: max(0, min(real, stop) - start)].double()
            acc += torch.dot(head, head)
            pack_signs(y, out_bits[start // 8 : stop // 8])
        return float(acc)

    def decode(self, bits: torch.Tensor, scale: float, out: torch.Tensor) -> None:
        """out (float dtype, len <= 8 * len(bits)) <- scale * sign coded by `bits`."""
        plus, minus = sign_patterns(scale, out.dtype)
        if self._fused(
            "cc_decode",
            out.device,
            out.numel(),
            (bits, out),
            (bits.data_ptr(), out.numel(), out.element_size(), plus, minus, out.data_ptr()),
        ):
            return
        values = torch.tensor([scale, -scale], dtype=torch.float32).to(out.dtype)
        table = sign_table(values[0].to(out.device), values[1].to(out.device))
        step, whole = block_size(out.device), out.numel() // 8 * 8
        for start in range(0, whole, step):
            stop = min(start + step, whole)
            out[start:stop].copy_(table[bits[start // 8 : stop // 8].long()].view(-1))
        if whole < out.numel():
            out[whole:].copy_(table[bits[whole // 8].long()][: out.numel() - whole])

    def __repr__(self) -> str:
        return f"<Codec: {self.why}>"


_codecs: dict[tuple[str, int | None], Codec] = {}


def codec_for(device: torch.device | str) -> Codec:
    """The codec of `device`, chosen at its first use and kept: the fused kernels when they can
    be had, else the torch code, with a RuntimeWarning saying why (once per device).

    Switches, read at that first use: COMPCOMM_NATIVE=0 keeps the C kernels off and
    COMPCOMM_CUDA_KERNELS=0 the CUDA ones (both give the same bits as the torch code).
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (device.type, device.index)
    if key not in _codecs:
        _codecs[key] = _choose(device)
    return _codecs[key]


def _choose(device: torch.device) -> Codec:
    if device.type == "cpu":
        return _choose_native()
    if device.type == "cuda":
        return _choose_cuda(device)
    return Codec(None, f"torch kernels (no fused kernels for {device.type})")


def _choose_native() -> Codec:
    if os.environ.get("COMPCOMM_NATIVE", "1") == "0":
        return Codec(None, "torch kernels (COMPCOMM_NATIVE=0)")
    path = _native.library_path()
    if path is None:
        why = (
            "torch kernels: the C codec was not compiled when compcomm was installed (no C compiler?); "
            f"results are the same bits, {_FALLBACK_SLOWDOWN}. Reinstall with a C compiler to get it"
        )
        warnings.warn(f"compcomm: {why}", RuntimeWarning, stacklevel=4)
        return Codec(None, why)
    try:
        return Codec(_native.NativeKernels(path))
    except _native.StaleLibrary as exc:
        why = f"torch kernels: {exc}; results are the same bits, {_FALLBACK_SLOWDOWN}"
        warnings.warn(f"compcomm: {why}", RuntimeWarning, stacklevel=4)
        return Codec(None, why)


def _choose_cuda(device: torch.device) -> Codec:
    if os.environ.get("COMPCOMM_CUDA_KERNELS", "1") == "0":
        return Codec(None, "torch kernels (COMPCOMM_CUDA_KERNELS=0)")
    if importlib.util.find_spec("cupy") is None:
        return Codec(None, "torch kernels (cupy is not installed: pip install compcomm[cuda] for the fused ones)")
    try:
        return Codec(_cuda.CudaKernels(device))
    except Exception as exc:  # noqa: BLE001 - whatever cupy/NVRTC raises, the torch kernels remain
        why = (
            f"torch kernels: the fused CUDA kernels failed to compile ({type(exc).__name__}: {exc}); "
            "same bits, more slowly. Set COMPCOMM_CUDA_KERNELS=0 to silence this"
        )
        warnings.warn(f"compcomm: {why}", RuntimeWarning, stacklevel=4)
        return Codec(None, why)


def codec_info() -> dict[str, str]:
    """What runs the codec on each device type here, in words: {"cpu": ..., "cuda": ...} (cuda
    only where a GPU is). Chooses the codecs if no call has yet, so it may compile the CUDA
    kernels."""
    info = {"cpu": codec_for("cpu").why}
    if torch.cuda.is_available():
        info["cuda"] = codec_for("cuda").why
    return info

"""The error-compensated 1-bit allreduce (SPEC section 3), written once for every backend.

For world size n and N elements padded to M = ceil(N / 8n) * 8n, chunk C = M / n:

    worker r:   x' = pad(x) + e_w           s_r = ||x'[:N]|| / sqrt(N)
                e_w <- x' - s_r sign(x')     (0 on padding)
    phase 0:    all-gather (status, s_r, N): every rank validates every rank's input
    phase 1:    all-to-all of packed signs: rank j gets chunk j of each sign(x'_r)
    server j:   y = (1/n) sum_r s_r sign(x'_r)[chunk j] + e_s       t_j = ||y[:k]|| / sqrt(k)
                e_s <- y - t_j sign(y)       (0 beyond the k real elements)
    phase 2:    all-gather of (t_j, packed sign(y)) in one collective
    output:     chunk j of the result is t_j sign(y_j) on every rank, bit for bit.

Nothing is modified before phase 0 has shown that every rank's call is valid, so a rejected
call raises the same error on every rank and leaves tensors and error state untouched.
"""
from __future__ import annotations

from typing import Literal, overload

import numpy as np
import torch

from . import codec
from .backends import Backend, resolve
from .error_feedback import ErrorFeedback
from .errors import NonFiniteError
from .layout import chunk_size, real_count
from .ordering import Pending, run_in_order, submit

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
OPS = ("mean", "sum")
_HEADER = np.dtype([("code", "<i4"), ("scale", "<f4"), ("numel", "<i8")])
_ERROR_CODES: dict[type, int] = {TypeError: 1, ValueError: 2}
_ERROR_CLASSES: dict[int, type] = {1: TypeError, 2: ValueError, 3: RuntimeError}
_MESSAGE_BYTES = 1024


@overload
def compressed_allreduce(tensor: torch.Tensor, error_feedback: ErrorFeedback, backend: Backend | str | None = None,
                         op: str = "mean", async_op: Literal[False] = False) -> torch.Tensor: ...


@overload
def compressed_allreduce(tensor: torch.Tensor, error_feedback: ErrorFeedback, backend: Backend | str | None = None,
                         op: str = "mean", *, async_op: Literal[True]) -> Pending: ...


@overload
def compressed_allreduce(tensor: torch.Tensor, error_feedback: ErrorFeedback, backend: Backend | str | None = None,
                         op: str = "mean", async_op: bool = False) -> torch.Tensor | Pending: ...


def compressed_allreduce(tensor: torch.Tensor, error_feedback: ErrorFeedback,
                         backend: Backend | str | None = None, op: str = "mean",
                         async_op: bool = False) -> torch.Tensor | Pending:
    """Average (op="mean") or sum (op="sum") `tensor` over all ranks in place, with 1-bit
    compression and error feedback carried in `error_feedback`; returns `tensor`.

    The result is bitwise identical on every rank. Raises TypeError, ValueError or
    NonFiniteError on every rank alike, with nothing modified, when any rank's call is bad.
    With async_op=True it returns at once a handle whose `wait()` returns the tensor (or
    raises); calls on one backend run in submission order, so every rank must submit its
    calls in the same order, as with any collective. Leave the tensor alone until `wait()`.
    """
    be = resolve(backend, tensor)
    if async_op:
        return submit(be, _allreduce, tensor, error_feedback, be, op)
    return run_in_order(be, _allreduce, tensor, error_feedback, be, op)


def _allreduce(tensor: torch.Tensor, ef: ErrorFeedback, be: Backend, op: str) -> torch.Tensor:
    n = be.world_size
    try:
        flat, signs, sum_sq = _local_scan(tensor, ef, be, op)
        numel = tensor.numel()
        scale, failure = codec.rms_scale(sum_sq, numel), None
    except Exception as exc:  # reported to every rank in phase 0, then raised everywhere
        flat, signs, scale, numel, failure = None, None, 0.0, 0, exc

    header = np.zeros(1, dtype=_HEADER)
    header["code"] = 0 if failure is None else _ERROR_CODES.get(type(failure), 3)
    header["scale"], header["numel"] = scale, numel
    gathered = torch.empty(n, _HEADER.itemsize, dtype=torch.uint8, device=be.device)
    be.all_gather(torch.from_numpy(header.view(np.uint8)).to(be.device), gathered)
    headers = np.frombuffer(gathered.cpu().numpy().tobytes(), dtype=_HEADER)
    _raise_if_rejected(headers, failure, be)

    if numel:
        _reduce(tensor, flat, ef, be, op, signs, headers["scale"].astype(np.float32), scale)
    return tensor


def _local_scan(tensor: torch.Tensor, ef: ErrorFeedback, be: Backend,
                op: str) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Validate this rank's arguments; return the flattened tensor (a view when contiguous),
    its packed worker signs (n, C/8) and sum(x'^2). Nothing is modified."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"compressed_allreduce takes a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in FLOAT_DTYPES:
        raise TypeError(f"compressed_allreduce takes float32, float16 or bfloat16 tensors, got {tensor.dtype}")
    if not isinstance(ef, ErrorFeedback):
        raise TypeError(f"error_feedback must be a compcomm.ErrorFeedback, got {type(ef).__name__}")
    if op not in OPS:
        raise ValueError(f"op must be 'mean' or 'sum', got {op!r}")
    if not be.serves(tensor.device):
        raise ValueError(f"the {be.name} backend cannot reduce tensors on {tensor.device} "
                         f"(it serves {be.device.type}); move the tensor or pick another backend")
    why = ef.mismatch(tensor.numel(), be.world_size)
    if why:
        raise ValueError(why)
    n, numel = be.world_size, tensor.numel()
    signs = torch.empty(n, chunk_size(numel, n) // 8, dtype=torch.uint8, device=tensor.device)
    worker = ef.worker_error.to(tensor.device) if ef.initialized else None
    flat = tensor.reshape(-1)
    return flat, signs, codec.codec_for(tensor.device).worker_scan(flat, worker, signs.view(-1))


def _raise_if_rejected(headers: np.ndarray, failure: Exception | None, be: Backend) -> None:
    """Raise the same error on every rank if any rank's call is invalid."""
    bad = np.flatnonzero(headers["code"])
    if bad.size:
        first = int(bad[0])
        message = _gather_message(str(failure) if failure else "", be)[first]
        raise _ERROR_CLASSES[int(headers["code"][first])](f"rank {first}: {message}") from failure
    sizes = headers["numel"]
    if (sizes != sizes[0]).any():
        raise ValueError(f"ranks passed tensors of different sizes (numel per rank: {sizes.tolist()}); "
                         "every rank must reduce the same number of elements")
    nonfinite = np.flatnonzero(~np.isfinite(headers["scale"]))
    if nonfinite.size:
        raise NonFiniteError(f"non-finite values (NaN/Inf) in the input of rank(s) {nonfinite.tolist()}; "
                             "nothing was reduced and no error state changed")


def _gather_message(text: str, be: Backend) -> list[str]:
    """All-gather each rank's failure text (only on the failure path, so it costs nothing normally)."""
    raw = text.encode()[:_MESSAGE_BYTES].ljust(_MESSAGE_BYTES, b"\0")
    out = torch.empty(be.world_size, _MESSAGE_BYTES, dtype=torch.uint8, device=be.device)
    be.all_gather(torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(be.device), out)
    return [bytes(row).rstrip(b"\0").decode(errors="replace") for row in out.cpu().numpy()]


def _reduce(tensor: torch.Tensor, flat: torch.Tensor, ef: ErrorFeedback, be: Backend, op: str,
            signs: torch.Tensor, scales: np.ndarray, scale: float) -> None:
    """Phases 1 and 2 and the decode, once phase 0 has accepted every rank's call.

    Each error update runs while the collective that does not depend on it is in flight.
    """
    n, rank, numel, device = be.world_size, be.rank, tensor.numel(), tensor.device
    c = chunk_size(numel, n)
    worker, server = ef.buffers(numel, n, device)
    coder = codec.codec_for(device)

    received = torch.empty_like(signs)
    in_flight = be.all_to_all(signs, received, async_op=True)
    coder.error_update_(worker, scale, numel, flat)
    in_flight.wait()
    del signs

    served = real_count(rank, numel, n)
    mine = torch.empty(4 + c // 8, dtype=torch.uint8, device=device)
    sum_sq = coder.server_scan_(received, torch.from_numpy(scales).to(device), n if op == "mean" else 1,
                              server, served, mine[4:])
    del received
    server_scale = codec.rms_scale(sum_sq, served)
    mine[:4].copy_(torch.tensor([server_scale], dtype=torch.float32).view(torch.uint8))
    everyone = torch.empty(n, 4 + c // 8, dtype=torch.uint8, device=device)
    in_flight = be.all_gather(mine, everyone, async_op=True)
    coder.error_update_(server, server_scale, served)
    in_flight.wait()

    server_scales = everyone[:, :4].reshape(-1).view(torch.float32).tolist()
    for j in range(n):
        start, k = j * c, real_count(j, numel, n)
        if k:
            coder.decode(everyone[j, 4:], server_scales[j], flat[start:start + k])
    if flat.data_ptr() != tensor.data_ptr() or not tensor.is_contiguous():
        tensor.copy_(flat.view(tensor.shape))

"""Kernel by kernel, the fused kernels (C; CUDA through cupy, or on the CPU emulation) give
the same bits as the torch kernels."""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable

import numpy as np
import pytest
import torch

from compcomm import _cuda, _native, codec
from cuda_emulation import build, compiler_missing, emulated_cuda

NO_GPU = "no CUDA device (torch.cuda.is_available() is False)"
KINDS = [
    pytest.param("c", marks=pytest.mark.skipif(not codec.native_available(),
                                               reason="the C codec was not built (no compiler at install time)")),
    pytest.param("cupy", marks=pytest.mark.skipif(not (torch.cuda.is_available() and _cuda.ENABLED),
                                                  reason=f"{NO_GPU} or cupy-cuda12x is not installed")),
    pytest.param("torch-cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU)),
    pytest.param("cuda-emulated", marks=pytest.mark.skipif(compiler_missing() is not None,
                                                           reason=str(compiler_missing()))),
]


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    return build(tmp_path_factory.mktemp("cuda_emulation"))


@dataclasses.dataclass
class Kernels:
    """Kernels under test: run fn in `context()` on tensors on `device`."""
    name: str
    device: str
    context: Callable[[], contextlib.AbstractContextManager]


@pytest.fixture(params=KINDS)
def kind(request) -> Kernels:
    """Which kernels are checked against the torch kernels on CPU: the C ones, the CUDA ones
    (cupy on a GPU, or emulated on the CPU) or the torch ones on a GPU (whose arithmetic must
    match the CPU's too)."""
    if request.param == "cuda-emulated":
        emulator = request.getfixturevalue("emulator")
        return Kernels(request.param, "cpu", lambda: emulated_cuda(emulator))
    if request.param == "torch-cuda":
        return Kernels(request.param, "cuda", torch_kernels)
    return Kernels(request.param, "cpu" if request.param == "c" else "cuda", contextlib.nullcontext)


@contextlib.contextmanager
def torch_kernels():
    """Turn the fused C and CUDA kernels off: the codec runs its torch code."""
    lib, enabled = _native.LIB, _cuda.ENABLED
    _native.LIB, _cuda.ENABLED = None, False
    try:
        yield
    finally:
        _native.LIB, _cuda.ENABLED = lib, enabled


def both(kernels: Kernels, fn, *args):
    """fn on copies of args with `kernels`, and with the torch kernels on CPU; the first
    result's tensors come back on CPU."""
    fast_args = [a.to(kernels.device, copy=True) if isinstance(a, torch.Tensor) else a for a in args]
    torch_args = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    with kernels.context():
        fast_out = fn(*fast_args)
    assert kernels.name != "cupy" or _cuda.ENABLED, "the CUDA kernels could not be compiled (see the warning)"
    with torch_kernels():
        torch_out = fn(*torch_args)
    return (fast_out, [a.cpu() if isinstance(a, torch.Tensor) else a for a in fast_args]), (torch_out, torch_args)


def same_bits(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.view(torch.uint8).equal(b.view(torch.uint8)) if a.numel() else True
    return a == b


def data(numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    x = torch.randn(numel, generator=torch.Generator().manual_seed(seed)).to(dtype)
    x[::7] = -0.0
    x[1::11] = 0.0
    return x


@pytest.mark.parametrize("numel", [1, 7, 8, 1000, 70001])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_worker_scan_and_update(kind, numel, dtype):
    x = data(numel, dtype, 0)
    m = -(-numel // 32) * 32
    error = torch.zeros(m)
    error[:numel] = data(numel, torch.float32, 1) * 0.3
    for e in (None, error):
        (n_sum, n_args), (t_sum, t_args) = both(kind, codec.worker_scan, x, e, torch.empty(m // 8, dtype=torch.uint8))
        assert same_bits(n_args[2], t_args[2])
        assert n_sum == pytest.approx(t_sum, rel=1e-12)
    (_, n_args), (_, t_args) = both(kind, codec.error_update_, error, 0.625, numel, x)
    assert same_bits(n_args[0], t_args[0])
    assert torch.equal(n_args[0][numel:], torch.zeros(m - numel))


@pytest.mark.parametrize("n, c, real", [(1, 8, 3), (3, 64, 64), (4, 4096, 4000), (5, 8192, 8013), (4, 4096, 0)])
def test_server_scan_and_update(kind, n, c, real):
    g = torch.Generator().manual_seed(n + c)
    bits = torch.randint(0, 256, (n, c // 8), dtype=torch.uint8, generator=g)
    scales = torch.rand(n, generator=g) + 0.1
    error = torch.randn(c, generator=g) * 0.2
    for divisor in (1, n):
        (n_sum, n_args), (t_sum, t_args) = both(kind, codec.server_scan_, bits, scales, divisor, error, real,
                                                torch.empty(c // 8, dtype=torch.uint8))
        assert same_bits(n_args[3], t_args[3]) and same_bits(n_args[5], t_args[5])
        assert n_sum == pytest.approx(t_sum, rel=1e-12)
    (_, n_args), (_, t_args) = both(kind, codec.error_update_, error, 0.3, real)
    assert same_bits(n_args[0], t_args[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("count", [1, 8, 13, 4096])
def test_decode(kind, dtype, count):
    bits = torch.randint(0, 256, (-(-count // 8),), dtype=torch.uint8, generator=torch.Generator().manual_seed(count))
    (_, n_args), (_, t_args) = both(kind, codec.decode, bits, 0.1234567, torch.empty(count, dtype=dtype))
    assert same_bits(n_args[2], t_args[2])
    expected = np.where(np.unpackbits(bits.numpy())[:count] == 1, 1.0, -1.0) * np.float32(0.1234567)
    assert torch.equal(n_args[2], torch.from_numpy(expected.astype(np.float32)).to(dtype))


def test_msb_first_bits_and_negative_zero():
    x = torch.tensor([1.0, -1.0, -0.0, 0.0, -2.0, 3.0, -4.0, -5.0])
    bits = torch.empty(1, dtype=torch.uint8)
    codec.worker_scan(x, None, bits)
    assert bits.item() == 0b10110100

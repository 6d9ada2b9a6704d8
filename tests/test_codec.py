"""The fused C kernels and the pure-torch fallback give the same bits, kernel by kernel."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from compcomm import _native, codec

pytestmark = pytest.mark.skipif(not codec.native_available(),
                                reason="the C codec was not built (no compiler at install time)")


def both(fn, *args):
    """Run fn on copies of args with the C kernels and with the torch fallback."""
    native_args = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    torch_args = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    native_out = fn(*native_args)
    lib, _native.LIB = _native.LIB, None
    try:
        torch_out = fn(*torch_args)
    finally:
        _native.LIB = lib
    return (native_out, native_args), (torch_out, torch_args)


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
def test_worker_scan_and_update(numel, dtype):
    x = data(numel, dtype, 0)
    m = -(-numel // 32) * 32
    error = torch.zeros(m)
    error[:numel] = data(numel, torch.float32, 1) * 0.3
    for e in (None, error):
        (n_sum, n_args), (t_sum, t_args) = both(codec.worker_scan, x, e, torch.empty(m // 8, dtype=torch.uint8))
        assert same_bits(n_args[2], t_args[2])
        assert n_sum == pytest.approx(t_sum, rel=1e-12)
    (_, n_args), (_, t_args) = both(codec.error_update_, error, 0.625, numel, x)
    assert same_bits(n_args[0], t_args[0])
    assert torch.equal(n_args[0][numel:], torch.zeros(m - numel))


@pytest.mark.parametrize("n, c, real", [(1, 8, 3), (3, 64, 64), (4, 4096, 4000), (4, 4096, 0)])
def test_server_scan_and_update(n, c, real):
    g = torch.Generator().manual_seed(n + c)
    bits = torch.randint(0, 256, (n, c // 8), dtype=torch.uint8, generator=g)
    scales = torch.rand(n, generator=g) + 0.1
    error = torch.randn(c, generator=g) * 0.2
    for divisor in (1, n):
        (n_sum, n_args), (t_sum, t_args) = both(codec.server_scan_, bits, scales, divisor, error, real,
                                                torch.empty(c // 8, dtype=torch.uint8))
        assert same_bits(n_args[3], t_args[3]) and same_bits(n_args[5], t_args[5])
        assert n_sum == pytest.approx(t_sum, rel=1e-12)
    (_, n_args), (_, t_args) = both(codec.error_update_, error, 0.3, real)
    assert same_bits(n_args[0], t_args[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("count", [1, 8, 13, 4096])
def test_decode(dtype, count):
    bits = torch.randint(0, 256, (-(-count // 8),), dtype=torch.uint8, generator=torch.Generator().manual_seed(count))
    (_, n_args), (_, t_args) = both(codec.decode, bits, 0.1234567, torch.empty(count, dtype=dtype))
    assert same_bits(n_args[2], t_args[2])
    expected = np.where(np.unpackbits(bits.numpy())[:count] == 1, 1.0, -1.0) * np.float32(0.1234567)
    assert torch.equal(n_args[2], torch.from_numpy(expected.astype(np.float32)).to(dtype))


def test_msb_first_bits_and_negative_zero():
    x = torch.tensor([1.0, -1.0, -0.0, 0.0, -2.0, 3.0, -4.0, -5.0])
    bits = torch.empty(1, dtype=torch.uint8)
    codec.worker_scan(x, None, bits)
    assert bits.item() == 0b10110100

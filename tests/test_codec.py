"""Kernel by kernel, the fused kernels (C; CUDA through cupy, or on the CPU emulation) give
the same bits as the torch kernels."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from compcomm import _abi, _cuda, _native
from compcomm.codec import Codec, codec_for, divide_
from compcomm.errors import largest_magnitude

from cuda_emulation import EmulatedCudaKernels, build, compiler_missing

NO_GPU = "no CUDA device (torch.cuda.is_available() is False)"
HAS_CUPY = importlib.util.find_spec("cupy") is not None
TORCH = Codec(None)
KINDS = [
    pytest.param(
        "c",
        marks=pytest.mark.skipif(
            _native.library_path() is None, reason="the C codec was not built (no compiler at install time)"
        ),
    ),
    pytest.param(
        "cupy",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(
                not (torch.cuda.is_available() and HAS_CUPY), reason=f"{NO_GPU} or cupy-cuda12x is not installed"
            ),
        ],
    ),
    pytest.param(
        "torch-cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU)]
    ),
    pytest.param(
        "cuda-emulated", marks=pytest.mark.skipif(compiler_missing() is not None, reason=str(compiler_missing()))
    ),
]


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    return build(tmp_path_factory.mktemp("cuda_emulation"))


@dataclasses.dataclass
class Kernels:
    """Kernels under test: `codec` run on tensors on `device`."""

    name: str
    device: str
    codec: Codec


@pytest.fixture(params=KINDS)
def kind(request) -> Kernels:
    """Which kernels are checked against the torch kernels on CPU: the C ones, the CUDA ones
    (cupy on a GPU, or emulated on the CPU) or the torch ones on a GPU (whose arithmetic must
    match the CPU's too)."""
    if request.param == "cuda-emulated":
        return Kernels(request.param, "cpu", Codec(EmulatedCudaKernels(request.getfixturevalue("emulator"))))
    if request.param == "torch-cuda":
        return Kernels(request.param, "cuda", TORCH)
    if request.param == "cupy":  # compiling raises here if NVRTC cannot build the kernels
        return Kernels(request.param, "cuda", Codec(_cuda.CudaKernels(torch.device("cuda"))))
    return Kernels(request.param, "cpu", Codec(_native.NativeKernels(str(_native.library_path()))))


def both(kernels: Kernels, method: str, *args):
    """Codec pass `method` on copies of args with `kernels`, and with the torch kernels on CPU;
    the first result's tensors come back on CPU."""
    fast_args = [a.to(kernels.device, copy=True) if isinstance(a, torch.Tensor) else a for a in args]
    torch_args = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    fast_out = getattr(kernels.codec, method)(*fast_args)
    torch_out = getattr(TORCH, method)(*torch_args)
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
        (n_sum, n_args), (t_sum, t_args) = both(kind, "worker_scan", x, e, torch.empty(m // 8, dtype=torch.uint8))
        assert same_bits(n_args[2], t_args[2])
        assert n_sum == pytest.approx(t_sum, rel=1e-12)
    (n_peak, n_args), (t_peak, t_args) = both(kind, "error_update_", error, 0.625, numel, x, None, True)
    assert same_bits(n_args[0], t_args[0])
    assert n_peak == t_peak == largest_magnitude(t_args[0])
    assert torch.equal(n_args[0][numel:], torch.zeros(m - numel))
    # into another buffer (garbage before): the same bits, and the old errors left as they were
    (o_peak, o_args), (u_peak, u_args) = both(kind, "error_update_", error, 0.625, numel, x, torch.full((m,), 7.0))
    assert o_peak is None and u_peak is None  # not asked for: no wait for the device
    assert same_bits(o_args[4], n_args[0]) and same_bits(u_args[4], n_args[0])
    assert same_bits(o_args[0], error) and same_bits(u_args[0], error)


@pytest.mark.parametrize("numel", [1, 7, 8, 1000, 70001])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_worker_scan_in_the_x_prime_form(kind, numel, dtype):
    """A scan whose errors come as the previous call's v and scale (error = v - s sign(v) on the
    real elements, 0 on the padding) gives the bits and sum of a scan over those errors made
    by `error_update_`, and writes the new v (x + error) into `out`."""
    x = data(numel, dtype, 2)
    m = -(-numel // 32) * 32
    previous = torch.zeros(m)
    previous[:numel] = data(numel, torch.float32, 3)
    errors = previous.clone()
    TORCH.error_update_(errors, 0.375, numel)
    expected_bits = torch.empty(m // 8, dtype=torch.uint8)
    expected_sum = TORCH.worker_scan(x, errors, expected_bits)
    expected_v = x.float().clone()
    expected_v = torch.cat([expected_v, torch.zeros(m - numel)]) + errors
    for out in (None, torch.full((m,), 7.0)):
        (n_sum, n_args), (t_sum, t_args) = both(
            kind, "worker_scan", x, previous, torch.empty(m // 8, dtype=torch.uint8), 0.375, out
        )
        for bits in (n_args[2], t_args[2]):
            assert same_bits(bits, expected_bits)
        assert n_sum == pytest.approx(expected_sum, rel=1e-12) and t_sum == expected_sum
        assert same_bits(n_args[1], previous)  # the previous call's v is only read
        if out is not None:
            assert same_bits(n_args[4], expected_v) and same_bits(t_args[4], expected_v)


@pytest.mark.parametrize("numel", [1, 7, 8, 1000, 70001])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("divisor", [1.0, 2.0, 3.0])
def test_worker_scan_forms_a_node_sum(kind, numel, dtype, divisor):
    """A scan given an addend and a divisor reads x as (x + addend) / divisor, in fp32: the
    same bits, sum and x' as a scan of that sum and division written out by torch (the
    hierarchical node step it replaces: `sum_in_rank_order`, then `div_`). 3 is a divisor
    whose reciprocal is inexact, so a multiplication would differ."""
    x, addend = data(numel, dtype, 4), data(numel, torch.float32, 5) * 3
    m = -(-numel // 32) * 32
    previous = torch.zeros(m)
    previous[:numel] = data(numel, torch.float32, 6)
    formed = x.float() + addend
    if divisor != 1.0:
        formed.div_(divisor)
    expected_bits, expected_out = torch.empty(m // 8, dtype=torch.uint8), torch.empty(m)
    expected_sum = TORCH.worker_scan(formed, previous, expected_bits, 0.375, expected_out)
    (n_sum, n_args), (t_sum, t_args) = both(
        kind, "worker_scan", x, previous, torch.empty(m // 8, dtype=torch.uint8), 0.375, torch.empty(m), addend, divisor
    )
    for args in (n_args, t_args):
        assert same_bits(args[2], expected_bits) and same_bits(args[4], expected_out)
    assert n_sum == pytest.approx(expected_sum, rel=1e-12) and t_sum == expected_sum
    with pytest.raises(ValueError, match="addend must be"):
        kind.codec.worker_scan(
            x.to(kind.device),
            None,
            torch.empty(m // 8, dtype=torch.uint8, device=kind.device),
            addend=addend[:-1].to(kind.device),
        )


ON_GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU)]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=ON_GPU)])
def test_divide_is_a_true_division_on_every_device(device):
    """`divide_` (the torch code's divisions: the worker scan's node mean, the server's 1/n, the
    exact sums, the hierarchical node mean written out) divides in fp32 as the kernels do. torch
    on CUDA multiplies by 1/3 when the divisor is a Python number: a third of these elements
    came out one ulp off."""
    x = data(10000, torch.float32, 7)
    expected = torch.from_numpy(x.numpy() / np.float32(3))
    assert same_bits(divide_(x.to(device, copy=True), 3).cpu(), expected)
    assert divide_(x.to(device, copy=True), 1).cpu().equal(x)
    half = (x * 100).half()  # a divisor that fp16 cannot hold (2049 -> 2048) is not rounded first
    expected = torch.from_numpy(half.numpy().astype(np.float32) / np.float32(2049)).half()
    assert same_bits(divide_(half.to(device, copy=True), 2049).cpu(), expected)


def test_update_into_a_buffer_overlapping_the_errors_is_refused(kind):
    """`out` is the errors themselves or separate memory: a shifted view of them would be read
    after being written (the C kernel gave wrong values, the torch code raised)."""
    base = torch.zeros(40, device=kind.device)
    with pytest.raises(ValueError, match="share no storage"):
        kind.codec.error_update_(base[:32], 0.5, 30, torch.ones(32, device=kind.device), base[1:33])
    x, bits = torch.ones(32, device=kind.device), torch.empty(4, dtype=torch.uint8, device=kind.device)
    with pytest.raises(ValueError, match="share no storage"):
        kind.codec.worker_scan(x, base[:32], bits, 0.5, base[8:40])  # the scan's x' over its errors
    with pytest.raises(ValueError, match="share no storage"):
        kind.codec.worker_scan(x, None, bits, None, x)


def test_empty_buffers_overlap_nothing(kind):
    """Empty tensors may all have address 0: an empty part (a hierarchical rank whose share of
    a 1-element tensor is nothing) is not an overlap (refusing it hung the other ranks' call)."""
    empty = torch.empty(0, device=kind.device)
    out = torch.empty(0, device=kind.device)
    kind.codec.error_update_(empty, 0.5, 0, out=out)
    bits = torch.empty(0, dtype=torch.uint8, device=kind.device)
    assert kind.codec.worker_scan(empty, empty, bits, 0.5, out) == 0.0


@pytest.mark.parametrize("n, c, real", [(1, 8, 3), (3, 64, 64), (4, 4096, 4000), (5, 8192, 8013), (4, 4096, 0)])
def test_server_scan_and_update(kind, n, c, real):
    g = torch.Generator().manual_seed(n + c)
    bits = torch.randint(0, 256, (n, c // 8), dtype=torch.uint8, generator=g)
    scales = torch.rand(n, generator=g) + 0.1
    error = torch.randn(c, generator=g) * 0.2
    for divisor in (1, n):
        (n_sum, n_args), (t_sum, t_args) = both(
            kind, "server_scan_", bits, scales, divisor, error, real, torch.empty(c // 8, dtype=torch.uint8)
        )
        assert same_bits(n_args[3], t_args[3]) and same_bits(n_args[5], t_args[5])
        assert n_sum == pytest.approx(t_sum, rel=1e-12)
    (n_peak, n_args), (t_peak, t_args) = both(kind, "error_update_", error, 0.3, real, None, None, True)
    assert same_bits(n_args[0], t_args[0])
    assert n_peak == t_peak == largest_magnitude(t_args[0])


@pytest.mark.parametrize("special", [math.nan, -math.inf, -50.0])
@pytest.mark.parametrize("where", [0, 4000, 8012])
def test_the_error_update_returns_the_largest_magnitude_it_wrote(kind, special, where):
    """max |new error| over the real elements, from the update's own pass (a NaN wins, then an
    infinity of either sign; the padding, NaN here, does not count), on several blocks of
    threads where the kernels are CUDA's."""
    c, real = 8192, 8013
    error = torch.randn(c, generator=torch.Generator().manual_seed(where)) * 0.2
    error[where] = special
    error[real:] = math.nan
    (n_peak, _), (t_peak, t_args) = both(kind, "error_update_", error, 0.3, real, None, None, True)
    expected = largest_magnitude(t_args[0][:real])
    assert (math.isnan(n_peak) and math.isnan(t_peak) and math.isnan(expected)) or n_peak == t_peak == expected
    assert {math.nan: math.isnan, -math.inf: math.isinf, -50.0: lambda e: 49.6 < e < 49.8}[special](expected)


@pytest.mark.parametrize("n, c, real", [(1, 8, 3), (4, 4096, 4000), (5, 8192, 8013)])
def test_server_scan_reads_the_previous_errors_where_they_lie(kind, n, c, real):
    """`previous`: the server pass reads the errors before the call from another buffer (a
    call that keeps the old state) and writes y into `error`, bitwise as in place; `previous`
    is left as it was, and one that overlaps `error` is refused."""
    g = torch.Generator().manual_seed(n * c)
    bits = torch.randint(0, 256, (n, c // 8), dtype=torch.uint8, generator=g).to(kind.device)
    scales = (torch.rand(n, generator=g) + 0.1).to(kind.device)
    before = (torch.randn(c, generator=g) * 0.2).to(kind.device)
    for divisor in (1, n):
        in_place, in_place_bits = before.clone(), torch.empty(c // 8, dtype=torch.uint8, device=kind.device)
        expected = kind.codec.server_scan_(bits, scales, divisor, in_place, real, in_place_bits)
        previous, y = before.clone(), torch.full((c,), float("nan"), device=kind.device)
        out_bits = torch.empty_like(in_place_bits)
        assert kind.codec.server_scan_(bits, scales, divisor, y, real, out_bits, previous) == expected
        assert same_bits(y, in_place) and same_bits(out_bits, in_place_bits)
        assert same_bits(previous, before)
    whole, half = before.clone(), c // 2
    with pytest.raises(ValueError, match="share no memory"):
        kind.codec.server_scan_(bits[:, : half // 8], scales, 1, whole[:half], real // 2, out_bits, whole[1 : half + 1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("count", [1, 8, 13, 4096])
def test_decode(kind, dtype, count):
    bits = torch.randint(0, 256, (-(-count // 8),), dtype=torch.uint8, generator=torch.Generator().manual_seed(count))
    (_, n_args), (_, t_args) = both(kind, "decode", bits, 0.1234567, torch.empty(count, dtype=dtype))
    assert same_bits(n_args[2], t_args[2])
    expected = np.where(np.unpackbits(bits.numpy())[:count] == 1, 1.0, -1.0) * np.float32(0.1234567)
    assert torch.equal(n_args[2], torch.from_numpy(expected.astype(np.float32)).to(dtype))


NATIVE_BUILT = pytest.mark.skipif(_native.library_path() is None, reason="the C codec was not built")
STREAMED = 4 << 20
"""Bytes per call from which the C kernels write with non-temporal stores (STREAM_BYTES in codec.c)."""


@NATIVE_BUILT
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("offset", [0, 1])
def test_large_decode_gives_the_same_bits_streamed_or_not(dtype, offset):
    """A decode of 4 MiB or more into 32-byte aligned memory (offset 0) takes the streaming
    stores, into misaligned memory (offset 1) the plain ones: the same bits either way."""
    count = STREAMED // dtype.itemsize + 13
    bits = torch.randint(0, 256, (-(-count // 8),), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    out = torch.full((count + offset,), 7.0, dtype=dtype)[offset:]
    Codec(_native.NativeKernels(str(_native.library_path()))).decode(bits, 0.1234567, out)
    expected = torch.empty(count, dtype=dtype)
    TORCH.decode(bits, 0.1234567, expected)
    assert same_bits(out, expected)


@NATIVE_BUILT
@pytest.mark.parametrize("offset", [0, 1])
@pytest.mark.parametrize("with_x", [None, 1001])
def test_large_update_into_another_buffer_gives_the_same_bits_streamed_or_not(offset, with_x):
    """An error update of 4 MiB or more into another buffer streams its stores when that buffer
    is aligned (offset 0): the bits of the in-place update, and the old errors untouched. With
    an x shorter than the errors (1001 elements: v = x + e there, e beyond) the rows after x
    start unaligned; streaming them crashed the process."""
    numel = STREAMED // 4 + 13
    m = -(-numel // 32) * 32
    x, error = data(with_x or numel, torch.float32, 4), torch.zeros(m)
    error[:numel] = data(numel, torch.float32, 5) * 0.3
    kept = error.clone()
    out = torch.full((m + offset,), 7.0)[offset:]
    native = Codec(_native.NativeKernels(str(_native.library_path())))
    native.error_update_(error, 0.625, numel, x, out)
    assert same_bits(error, kept)
    TORCH.error_update_(kept, 0.625, numel, x)
    assert same_bits(out, kept)


def test_msb_first_bits_and_negative_zero():
    x = torch.tensor([1.0, -1.0, -0.0, 0.0, -2.0, 3.0, -4.0, -5.0])
    bits = torch.empty(1, dtype=torch.uint8)
    codec_for("cpu").worker_scan(x, None, bits)
    assert bits.item() == 0b10110100


def test_python_abi_matches_the_shared_header():
    """compcomm/_abi.py and compcomm/csrc/codec_abi.h declare the same kernels and dtype codes."""
    header = (Path(_cuda.SOURCE_DIR) / "codec_abi.h").read_text()
    kinds = {
        "const void *": _abi.PTR,
        "void *": _abi.PTR,
        "const float *": _abi.PTR,
        "float *": _abi.PTR,
        "const unsigned char *": _abi.PTR,
        "unsigned char *": _abi.PTR,
        "double *": _abi.PTR,
        "int": _abi.I32,
        "cc_index": _abi.I64,
        "float": _abi.F32,
        "unsigned int": _abi.U32,
    }
    declared = {}
    for name, params in re.findall(r"CC_KERNEL void (cc_\w+)\(([^)]*)\);", header):
        types = [re.sub(r"\s*\*\s*", " *", re.sub(r"\w+$", "", p.strip())).strip() for p in params.split(",")]
        declared[name] = tuple(kinds[t] for t in types)
    assert declared == _abi.SIGNATURES
    enum = dict(re.findall(r"CC_(F32|F16|BF16) = (\d+)", header))
    assert {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16} == {
        k: next(d for d, code in _abi.DTYPE_CODES.items() if code == int(v)) for k, v in enum.items()
    }
    assert re.search(r"#define CC_ABI_VERSION (\d+)", header).group(1) == str(_abi.ABI_VERSION)


def test_a_c_library_built_from_other_source_is_refused(monkeypatch):
    """A library whose kernel interface is not this source's (an editable install not rebuilt
    after a kernel's parameters changed) would read its arguments otherwise: it is refused, and
    the torch kernels run instead, saying why."""
    from compcomm import _native, codec

    path = _native.library_path()
    if path is None:
        pytest.skip("the C codec was not built")
    assert _native.NativeKernels(path).lib.cc_abi_version() == _abi.ABI_VERSION
    monkeypatch.setattr(_native, "ABI_VERSION", _abi.ABI_VERSION + 1)
    with pytest.raises(_native.StaleLibrary, match="rebuild it"):
        _native.NativeKernels(path)
    with pytest.warns(RuntimeWarning, match="built from other source"):
        fallback = codec._choose_native()
    assert fallback.kernels is None and "rebuild it" in fallback.why

"""The C kernels in every configuration give the same bits: each kernel set (AVX-512, AVX2 +
FMA, portable C) on 1, 2 or 3 threads, against the torch kernels and against each other, the
float64 sums of squares included (the order of their additions is documented in codec.c and
rebuilt here in numpy); and the configuration that runs is the one named."""

from __future__ import annotations

import math
import multiprocessing
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

from compcomm import _native, codec
from compcomm.codec import Codec
from compcomm.errors import largest_magnitude

pytestmark = pytest.mark.skipif(_native.library_path() is None, reason="the C codec was not built")

TORCH = Codec(None)
BLOCK = 1 << 16
"""Elements per block of the C kernels (BLOCK in codec.c): the unit of partial sums and threads."""
STREAMED = 4 << 20
"""Bytes per call from which decodes and updates into another buffer stream (STREAM_BYTES)."""


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            line = next((ln for ln in f if ln.startswith("flags")), "")
    except OSError:
        return set()
    return set(line.split(":", 1)[-1].split())


FLAGS = _cpu_flags()
HAS_AVX2 = {"avx2", "fma", "f16c"} <= FLAGS
HAS_AVX512 = HAS_AVX2 and {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= FLAGS
ISAS = ["avx512", "avx2", "portable"]
CONFIGS = [(isa, threads) for isa in ISAS for threads in (1, 2, 3)]


def native(isa: str, threads: int) -> Codec:
    """The C kernels capped at `isa`, on `threads` threads from the smallest pass up."""
    return Codec(_native.NativeKernels(str(_native.library_path()), isa=isa, threads=threads, split_min=0))


@pytest.fixture(scope="module")
def codecs() -> dict[tuple[str, int], Codec]:
    return {config: native(*config) for config in CONFIGS}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.view(torch.uint8).equal(b.view(torch.uint8))


def same_value(a: float, b: float) -> bool:
    """Equal, or both NaN (whatever their payloads)."""
    return a == b or (math.isnan(a) and math.isnan(b))


def data(numel: int, dtype: torch.dtype, seed: int, offset: int = 0) -> torch.Tensor:
    """numel values (zeros of both signs among them) starting `offset` elements into their
    buffer, so that offset 1 gives addresses aligned to nothing wider than the element."""
    x = torch.randn(numel + offset, generator=torch.Generator().manual_seed(seed)).to(dtype)
    x[::7] = -0.0
    x[1::11] = 0.0
    return x[offset:]


# Lengths: under one group of 32, partial vectors of 16 and 64, one block plus a partial group,
# several blocks with a partial last one (so that 2 and 3 threads share them unevenly).
LENGTHS = [1, 13, 40, 100, 1000, BLOCK + 40, 3 * BLOCK + 1001]


@pytest.mark.parametrize("numel", LENGTHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("offset", [0, 1])
def test_worker_scan_is_the_same_in_every_configuration(codecs, numel, dtype, offset):
    m = -(-numel // 64) * 64 + 8  # padding beyond x, as in an allreduce
    x = data(numel, dtype, numel, offset)
    error = torch.zeros(m + offset)[offset:]
    error[:numel] = data(numel, torch.float32, numel + 1) * 0.3
    for e in (error, None):
        expected = torch.empty(m // 8, dtype=torch.uint8)
        torch_sum = TORCH.worker_scan(x, e, expected)
        sums = set()
        for config, coder in codecs.items():
            bits = torch.full((m // 8,), 0xA5, dtype=torch.uint8)
            sums.add(coder.worker_scan(x, e, bits))
            assert same_bits(bits, expected), config
        assert len(sums) == 1, f"sums of squares differ between configurations: {sums}"
        total = sums.pop()
        assert total == pytest.approx(torch_sum, rel=1e-12)
        assert total == reference_sum(x.float() if e is None else x.float() + e[:numel], m)


@pytest.mark.parametrize("numel", [*LENGTHS, STREAMED // 4 + 1001])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("offset", [0, 1])
def test_x_prime_scan_is_the_same_in_every_configuration(codecs, numel, dtype, offset):
    """The scan over errors held in the x' form (previous v and scale), writing the new v: the
    same bits, sum and v in every configuration as the torch kernels, and as a plain scan over
    the errors that `error_update_` makes of them. From STREAMED bytes the new v is written with
    streaming stores when its buffer is aligned (offset 0), with plain ones otherwise."""
    m = -(-numel // 64) * 64 + 8
    x = data(numel, dtype, numel + 4, offset)
    previous = torch.zeros(m + offset)[offset:]
    previous[:numel] = data(numel, torch.float32, numel + 5)
    errors = previous.clone()
    TORCH.error_update_(errors, 0.5, numel)
    expected_bits = torch.empty(m // 8, dtype=torch.uint8)
    expected_sum = TORCH.worker_scan(x, errors, expected_bits)
    expected_v = torch.zeros(m)
    expected_v[:numel] = x.float()
    expected_v += errors
    for config, coder in codecs.items():
        bits = torch.full((m // 8,), 0xA5, dtype=torch.uint8)
        out = torch.full((m + offset,), 7.0)[offset:]
        total = coder.worker_scan(x, previous, bits, 0.5, out)
        assert total == coder.worker_scan(x, errors, torch.empty_like(bits)), config
        assert total == pytest.approx(expected_sum, rel=1e-12), config
        assert same_bits(bits, expected_bits) and same_bits(out, expected_v), config


@pytest.mark.parametrize("numel", [*LENGTHS, STREAMED // 4 + 1001])
@pytest.mark.parametrize("offset", [0, 1])
def test_node_sum_scan_is_the_same_in_every_configuration(codecs, numel, offset):
    """The scan that forms x as (x + addend) / 3 (a hierarchical node's mean, fp32): the same
    bits, sum and x' in every configuration as a scan of that mean written out by torch."""
    m = -(-numel // 64) * 64 + 8
    x, addend = data(numel, torch.float32, numel + 6, offset), data(numel, torch.float32, numel + 7, offset)
    previous = torch.zeros(m + offset)[offset:]
    previous[:numel] = data(numel, torch.float32, numel + 8)
    expected_bits, expected_v = torch.empty(m // 8, dtype=torch.uint8), torch.empty(m)
    expected_sum = TORCH.worker_scan((x + addend).div_(3), previous, expected_bits, 0.5, expected_v)
    for config, coder in codecs.items():
        bits = torch.full((m // 8,), 0xA5, dtype=torch.uint8)
        out = torch.full((m + offset,), 7.0)[offset:]
        total = coder.worker_scan(x, previous, bits, 0.5, out, addend, 3.0)
        assert total == pytest.approx(expected_sum, rel=1e-12), config
        assert same_bits(bits, expected_bits) and same_bits(out, expected_v), config


@pytest.mark.parametrize("numel", LENGTHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("offset", [0, 1])
def test_error_update_is_the_same_in_every_configuration(codecs, numel, dtype, offset):
    m = -(-numel // 64) * 64 + 8
    x = data(numel, dtype, numel + 2, offset)
    error = torch.zeros(m)
    error[:numel] = data(numel, torch.float32, numel + 3) * 0.3
    for with_x in (x, x[: numel // 3], None):  # x as long as the errors, shorter, none (a server's)
        expected = error.clone()
        peak = TORCH.error_update_(expected, 0.625, numel, with_x, measure=True)
        assert peak == largest_magnitude(expected)
        for config, coder in codecs.items():
            in_place = error.clone()
            assert coder.error_update_(in_place, 0.625, numel, with_x, measure=True) == peak, config
            assert same_bits(in_place, expected), config
            out = torch.full((m + offset,), 7.0)[offset:]
            kept = error.clone()
            assert coder.error_update_(kept, 0.625, numel, with_x, out, measure=True) == peak, config
            assert same_bits(out, expected) and same_bits(kept, error), config


@pytest.mark.parametrize("numel", LENGTHS)
@pytest.mark.parametrize("where", ["first", "last", "middle"])
@pytest.mark.parametrize("special", [math.nan, math.inf, -math.inf, -1e30])
def test_error_update_returns_the_largest_magnitude_it_wrote_in_every_configuration(codecs, numel, where, special):
    """max |new error| comes back from the update's own pass (the server error's bound in the
    next call's phase 0), as largest_magnitude measures it: a NaN anywhere in the real
    elements makes it NaN, an infinity of either sign inf, a negative error counts by its
    magnitude, wherever in the blocks, vectors and threads' shares it lies; the padding
    beyond `real` (NaN there) does not count."""
    m = -(-numel // 64) * 64 + 8
    error = torch.zeros(m)
    error[:numel] = data(numel, torch.float32, numel + 9) * 0.3
    error[{"first": 0, "last": numel - 1, "middle": numel // 2}[where]] = special
    error[numel:] = math.nan
    expected = error.clone()
    peak = TORCH.error_update_(expected, 0.625, numel, measure=True)
    reference = largest_magnitude(expected[:numel])
    assert same_value(peak, reference)
    assert same_value(reference, abs(special) if not math.isfinite(special) else float(torch.tensor(1e30)))
    for config, coder in codecs.items():
        for out in (None, torch.full((m,), 7.0)):
            got = coder.error_update_(error.clone(), 0.625, numel, None, out, measure=True)
            assert same_value(got, reference), (config, got, reference)


@pytest.mark.parametrize(
    "ranks, c, real",
    [
        (1, 8, 3),
        (3, 96, 70),
        (4, 4096, 4000),
        (2, BLOCK + 64, BLOCK + 41),
        (5, 3 * BLOCK + 1000, 3 * BLOCK + 1000),
        (3, 2 * BLOCK + 96, 77),
        (4, 4096, 0),
    ],
)
@pytest.mark.parametrize("rows_apart", [False, True])
def test_server_scan_is_the_same_in_every_configuration(codecs, ranks, c, real, rows_apart):
    g = torch.Generator().manual_seed(ranks + c)
    received = torch.randint(0, 256, (ranks, c // 8 + (3 if rows_apart else 0)), dtype=torch.uint8, generator=g)
    bits = received[:, : c // 8]  # rows_apart: each row contiguous, the rows 3 bytes apart
    scales = torch.rand(ranks, generator=g) + 0.1
    scales[0] = 0.0  # a rank whose input was all zeros: its +-0 terms
    error = torch.randn(c, generator=g) * 0.2
    for divisor in (1, ranks):
        expected, expected_bits = error.clone(), torch.empty(c // 8, dtype=torch.uint8)
        torch_sum = TORCH.server_scan_(bits, scales, divisor, expected, real, expected_bits)
        sums = set()
        for config, coder in codecs.items():
            y, out_bits = error.clone(), torch.empty(c // 8, dtype=torch.uint8)
            sums.add(coder.server_scan_(bits, scales, divisor, y, real, out_bits))
            assert same_bits(y, expected) and same_bits(out_bits, expected_bits), config
            kept, y = error.clone(), torch.full((c,), float("nan"))  # the errors before, read where they lie
            sums.add(coder.server_scan_(bits, scales, divisor, y, real, out_bits, kept))
            assert same_bits(y, expected) and same_bits(out_bits, expected_bits) and same_bits(kept, error), config
        assert len(sums) == 1, f"sums of squares differ between configurations: {sums}"
        total = sums.pop()
        assert total == pytest.approx(torch_sum, rel=1e-12) and total == reference_sum(expected[:real], c)


@pytest.mark.parametrize("count", [1, 13, 64, 100, 1000, BLOCK + 40, 3 * BLOCK + 1001])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("offset", [0, 1])
def test_decode_is_the_same_in_every_configuration(codecs, count, dtype, offset):
    bits = torch.randint(0, 256, (-(-count // 8),), dtype=torch.uint8, generator=torch.Generator().manual_seed(count))
    expected = torch.empty(count, dtype=dtype)
    TORCH.decode(bits, 0.1234567, expected)
    for config, coder in codecs.items():
        out = torch.full((count + offset,), 7.0, dtype=dtype)[offset:]
        coder.decode(bits, 0.1234567, out)
        assert same_bits(out, expected), config


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("offset", [0, 1, 8, 24])
def test_large_decodes_stream_from_any_row_alignment(codecs, dtype, offset):
    """Decodes of 4 MiB or more stream their stores when the output is aligned to one byte's
    eight elements (offsets 0, 8, 24: the AVX-512 kernels first write up to the next 64-byte
    boundary with plain stores), and use plain stores otherwise (offset 1)."""
    count = STREAMED // dtype.itemsize + 13
    bits = torch.randint(0, 256, (-(-count // 8),), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    expected = torch.empty(count, dtype=dtype)
    TORCH.decode(bits, 0.1234567, expected)
    for isa, threads in [("avx512", 1), ("avx512", 3), ("avx2", 2), ("portable", 2)]:
        out = torch.full((count + offset,), 7.0, dtype=dtype)[offset:]
        codecs[(isa, threads)].decode(bits, 0.1234567, out)
        assert same_bits(out, expected), (isa, threads)


@pytest.mark.parametrize("offset", [0, 1, 3, 16])
@pytest.mark.parametrize("x_length", [None, 1001, "all"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_updates_into_another_buffer_stream_from_any_alignment(codecs, offset, x_length, dtype):
    """Updates of 4 MiB or more into another buffer stream their stores (the AVX-512 kernels
    from any alignment, the AVX2 ones from 32-byte alignment): the bits of the in-place update,
    the old errors untouched; with x shorter than the errors the rows after it start anywhere."""
    numel = STREAMED // 4 + 13
    m = -(-numel // 32) * 32
    x = data(numel if x_length in (None, "all") else x_length, dtype, 4)
    with_x = None if x_length is None else x
    error = torch.zeros(m)
    error[:numel] = data(numel, torch.float32, 5) * 0.3
    expected = error.clone()
    TORCH.error_update_(expected, 0.625, numel, with_x)
    for isa, threads in [("avx512", 1), ("avx512", 2), ("avx2", 3), ("portable", 1)]:
        kept = error.clone()
        out = torch.full((m + offset,), 7.0)[offset:]
        codecs[(isa, threads)].error_update_(kept, 0.625, numel, with_x, out)
        assert same_bits(out, expected) and same_bits(kept, error), (isa, threads)


def reference_sum(values: torch.Tensor, padded: int) -> float:
    """sum(values^2) in float64, added in the order codec.c documents: per block of BLOCK
    elements, whole groups of 32 real elements into 32 lanes, folded into 8 as (E[k] + E[8+k])
    + (E[16+k] + E[24+k]); then the block's remaining bytes, element k of each into lane k;
    then ((l0 + l4) + (l1 + l5)) + ((l2 + l6) + (l3 + l7)); the blocks added in order."""
    squares = values.double().numpy() ** 2  # exact: an fp32 value's square fits a float64
    real, total = len(squares), 0.0
    for lo in range(0, padded, BLOCK):
        hi = min(lo + BLOCK, padded)
        groups = max(0, (min(hi, real) - lo) // 32)
        acc = np.zeros(32)
        for g in range(groups):
            acc += squares[lo + 32 * g : lo + 32 * g + 32]
        lanes = (acc[0:8] + acc[8:16]) + (acc[16:24] + acc[24:32])
        for start in range(lo + 32 * groups, min(hi, real), 8):
            byte = squares[start : min(start + 8, real)]
            lanes[: len(byte)] += byte
        total += ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]))
    return float(total)


@pytest.mark.skipif(not HAS_AVX512, reason="this CPU has no AVX-512 (F, BW, VL, DQ)")
def test_the_avx512_kernels_run_on_this_cpu():
    kernels = _native.NativeKernels(str(_native.library_path()))
    assert kernels.avx512 and kernels.lib.cc_cpu_features() == _native.AVX2 | _native.AVX512
    if not os.environ.get(_native.ISA_ENV):
        assert codec.codec_info()["cpu"].startswith("native C kernels (AVX-512)")
    codec.codec_for("cpu").worker_scan(torch.ones(8), None, torch.empty(1, dtype=torch.uint8))
    assert kernels.lib.cc_features() == _native.AVX2 | _native.AVX512  # what the last call used


@pytest.mark.skipif(not HAS_AVX2, reason="this CPU has no AVX2 + FMA + F16C")
def test_a_capped_kernel_set_is_named_and_used():
    kernels = _native.NativeKernels(str(_native.library_path()), isa="avx2", threads=2)
    assert kernels.description == "native C kernels (AVX2 + FMA" + (
        ", capped at avx2) on 2 threads" if HAS_AVX512 else ") on 2 threads"
    )
    Codec(kernels).worker_scan(torch.ones(8), None, torch.empty(1, dtype=torch.uint8))
    assert kernels.lib.cc_features() == _native.AVX2


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env={**os.environ, **env}
    )


def test_the_environment_picks_the_kernel_set_and_threads():
    code = "import compcomm; print(compcomm.codec_info()['cpu'])"
    done = _run(code, COMPCOMM_NATIVE_ISA="portable", COMPCOMM_CODEC_THREADS="3")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "native C kernels (portable, capped by COMPCOMM_NATIVE_ISA) on 3 threads"
    for env in ({"COMPCOMM_NATIVE_ISA": "sse9"}, {"COMPCOMM_CODEC_THREADS": "0"}):
        done = _run(code, **env)
        assert done.returncode != 0 and "ValueError" in done.stderr and next(iter(env)) in done.stderr


def test_threads_follow_torch_unless_set():
    kernels = _native.NativeKernels(str(_native.library_path()))
    if os.environ.get(_native.THREADS_ENV):
        pytest.skip(f"{_native.THREADS_ENV} is set")
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            Codec(kernels).decode(torch.zeros(1, dtype=torch.uint8), 1.0, torch.empty(8))
            assert _native._configured[kernels.path][1] == threads
    finally:
        torch.set_num_threads(before)


def test_concurrent_callers_share_the_pool_and_get_their_own_bits():
    """Passes called from several Python threads at once (the codec runs while collectives are
    in flight, without the GIL): one uses the pool, the others run on their own threads; every
    result is the one computed alone."""
    coder = native("avx512", 2)
    n = 3 * BLOCK + 5
    inputs = [data(n, torch.float32, seed) for seed in range(6)]
    alone = []
    for x in inputs:
        bits = torch.empty(-(-n // 8), dtype=torch.uint8)
        alone.append((coder.worker_scan(x, None, bits), bits))
    failures: list[int] = []

    def scan(i: int) -> None:
        for _ in range(20):
            bits = torch.empty(-(-n // 8), dtype=torch.uint8)
            total = coder.worker_scan(inputs[i], None, bits)
            if total != alone[i][0] or not same_bits(bits, alone[i][1]):
                failures.append(i)

    threads = [threading.Thread(target=scan, args=(i,)) for i in range(len(inputs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads) and not failures


def _scan_in_child(queue) -> None:
    coder = native("avx512", 2)
    x = data(3 * BLOCK, torch.float32, 1)
    queue.put(coder.worker_scan(x, None, torch.empty(3 * BLOCK // 8, dtype=torch.uint8)))


@pytest.mark.skipif(sys.platform != "linux", reason="fork start method")
def test_a_forked_child_starts_its_own_pool():
    """The pool's threads do not survive fork(): a child forked after the parent used them
    splits its passes over a pool of its own instead of waiting for threads it does not have."""
    coder = native("avx512", 2)
    x = data(3 * BLOCK, torch.float32, 1)
    expected = coder.worker_scan(x, None, torch.empty(3 * BLOCK // 8, dtype=torch.uint8))
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_scan_in_child, args=(queue,))
    child.start()
    child.join(timeout=60)
    if child.is_alive():
        child.kill()
        pytest.fail("the forked child hung in the codec")
    assert child.exitcode == 0 and queue.get(timeout=5) == expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_sign_patterns_are_torchs_rounding(dtype):
    g = torch.Generator().manual_seed(0)
    values = torch.randn(20000, generator=g, dtype=torch.float64) * torch.exp(
        torch.randn(20000, generator=g, dtype=torch.float64) * 25
    )
    special = [0.0, 1.0, 0.1234567, 6.1e-5, 5.96e-8, 65504.0, 65520.0, 1e-40, 3.4e38, 1e39, float("inf")]
    mask, as_ints = (1 << (8 * dtype.itemsize)) - 1, torch.int32 if dtype.itemsize == 4 else torch.int16
    for v in special + values.tolist():
        ints = torch.tensor([v, -v], dtype=torch.float32).to(dtype).view(as_ints)
        assert codec.sign_patterns(v, dtype) == tuple(i & mask for i in ints.tolist()), v

"""Codec micro-benchmarks (pytest-benchmark), next to a plain memory copy of the same size.

    pytest bench/test_codec_speed.py                         # 256K, 4M, 25M elements (1, 16, 100 MiB fp32)
    COMPCOMM_BENCH_SIZES=1M,16M pytest bench/test_codec_speed.py
    COMPCOMM_BENCH_THREADS=1,2 pytest bench/test_codec_speed.py     # torch.set_num_threads per run
    COMPCOMM_BENCH_DTYPES=float32,bfloat16 pytest bench/test_codec_speed.py
    COMPCOMM_BENCH_ISAS=avx512,avx2 pytest bench/test_codec_speed.py  # C kernels capped at each ISA
    COMPCOMM_BENCH_DEVICES=cuda pytest bench/test_codec_speed.py    # default: cpu, and cuda if present
    pytest bench/test_codec_speed.py --benchmark-json out.json

Every kernel reports GB/s as (4 bytes per element, whatever the input dtype) / (median time), in
`extra_info["GBps"]`, so that dtypes compare per element; a summary table at the end gives each
as a fraction of the copy's GB/s (fp32, same threads), measured in the same run. Not part of the
test suite (its testpaths is tests/).

    copy           dst.copy_(src), N fp32 (torch's copy, on the same number of threads)
    scan           codec.worker_scan: v = x + error, bits = sign(v), sum(v^2) (worker pass 1)
    update         codec.error_update_: error <- v - s sign(v) (worker pass 2)
    update_out     the same into another buffer, error unchanged (the optimizers' error_feedback_out)
    compress       scan + update: the whole worker side, compress and error update
    server         codec.server_scan_ + error_update_: a served chunk of N elements, 4 ranks
    decode         codec.decode: N outputs (in the dtype) from N/8 bytes and a scale

`COMPCOMM_BENCH_THREADS` sets torch.set_num_threads, which the C codec follows (unless
COMPCOMM_CODEC_THREADS is set); `COMPCOMM_BENCH_ISAS` builds the C kernels once per instruction
set (`avx512`, `avx2`, `portable`: the fastest the CPU has, at most that one) instead of the
codec chosen for the device. `COMPCOMM_BENCH_KERNELS` picks kernels by name.

On CPU the kernels are the fused C ones when built (see `codec.codec_info()`), else
torch; on CUDA the fused cupy ones when cupy is installed, else torch; the copy runs on the
same device, so on a GPU the fractions are of the device's measured memory bandwidth.
"""

from __future__ import annotations

import os
import re

import pytest
import torch

from compcomm import _native, codec

SERVER_RANKS = 4
ROUNDS = int(os.environ.get("COMPCOMM_BENCH_ROUNDS", "5"))


def _parse_count(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)\s*", text, re.I)
    if not m:
        raise ValueError(f"bad element count {text!r} in COMPCOMM_BENCH_SIZES (e.g. 1M,16M)")
    return int(m.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30}[m.group(2).upper()]


def _env_list(name: str, default: str) -> list[str]:
    return [s.strip() for s in os.environ.get(name, default).split(",") if s.strip()]


SIZES = [_parse_count(s) for s in _env_list("COMPCOMM_BENCH_SIZES", "256K,4M,25M")]
KERNELS = _env_list("COMPCOMM_BENCH_KERNELS", "copy,scan,update,update_out,compress,server,decode")
DEVICES = _env_list("COMPCOMM_BENCH_DEVICES", "cpu,cuda" if torch.cuda.is_available() else "cpu")
THREADS = [int(t) for t in _env_list("COMPCOMM_BENCH_THREADS", str(torch.get_num_threads()))]
DTYPES = _env_list("COMPCOMM_BENCH_DTYPES", "float32")
ISAS = _env_list("COMPCOMM_BENCH_ISAS", "default")
SHORT = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


def _label(n: int) -> str:
    return f"{n >> 20}M" if n % (1 << 20) == 0 else f"{n >> 10}K" if n % (1 << 10) == 0 else str(n)


def _coder(device: torch.device, isa: str) -> codec.Codec:
    if isa == "default" or device.type != "cpu":
        return codec.codec_for(device)
    path = _native.library_path()
    if path is None:
        pytest.skip("the C codec was not built")
    return codec.Codec(_native.NativeKernels(path, isa=isa))


def _setup(kernel: str, n: int, device: str, dtype: torch.dtype, isa: str):
    """A no-argument callable running `kernel` once on n elements on `device` (and waiting for
    it there)."""
    run = _kernel(kernel, n, torch.device(device), dtype, isa)
    if device == "cpu":
        return run
    return lambda: (run(), torch.cuda.synchronize(device))


def _kernel(kernel: str, n: int, device: torch.device, dtype: torch.dtype, isa: str):
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=gen).to(device)
    if kernel == "copy":
        dst = torch.empty_like(x)
        return lambda: dst.copy_(x)
    x = x.to(dtype)
    coder = _coder(device, isa)
    error = (torch.randn(n, generator=gen) * 0.1).to(device)
    bits = torch.empty(n // 8, dtype=torch.uint8, device=device)
    if kernel == "scan":
        return lambda: coder.worker_scan(x, error, bits)
    if kernel == "update":
        return lambda: coder.error_update_(error, 0.5, n, x)
    if kernel == "update_out":
        spare = torch.empty_like(error)
        return lambda: coder.error_update_(error, 0.5, n, x, spare)
    if kernel == "compress":
        return lambda: (coder.worker_scan(x, error, bits), coder.error_update_(error, 0.5, n, x))
    if kernel == "decode":
        out = torch.empty(n, device=device, dtype=dtype)
        return lambda: coder.decode(bits, 0.5, out)
    if kernel == "server":
        received = torch.randint(0, 256, (SERVER_RANKS, n // 8), dtype=torch.uint8, generator=gen).to(device)
        scales = (torch.rand(SERVER_RANKS, generator=gen) + 0.5).to(device)
        return lambda: (
            coder.server_scan_(received, scales, SERVER_RANKS, error, n, bits),
            coder.error_update_(error, 0.5, n),
        )
    raise ValueError(kernel)


@pytest.fixture(params=THREADS, ids=lambda t: f"T{t}")
def threads(request):
    """torch's (and so the C codec's) thread count for one benchmark, restored after it."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("n", SIZES, ids=_label)
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("isa", ISAS)
def test_codec_speed(benchmark, gbps_table, threads, isa, dtype, device, kernel, n):
    if kernel == "copy" and (dtype != DTYPES[0] or isa != ISAS[0]):
        pytest.skip("one copy per size and thread count")
    if kernel == "server" and dtype != "float32":
        pytest.skip("the server pass reads only bits and fp32")
    fn = _setup(kernel, n, device, getattr(torch, dtype), isa)
    config = f"{device} T={threads}" if kernel == "copy" else f"{device} T={threads} {SHORT[dtype]} {isa}"
    benchmark.group = f"codec {device} {_label(n)} elements, {threads} threads"
    benchmark.extra_info.update(
        device=device, kernel=kernel, elements=n, bytes=4 * n, threads=threads, dtype=dtype, isa=isa
    )
    benchmark.pedantic(fn, rounds=ROUNDS, warmup_rounds=1, iterations=1)
    stats = getattr(benchmark, "stats", None)
    if stats is not None:  # None under --benchmark-disable
        median = stats.stats.median
        benchmark.extra_info["GBps"] = 4 * n / median / 1e9
        gbps_table[(config, kernel, n)] = benchmark.extra_info["GBps"]

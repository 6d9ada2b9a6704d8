"""Codec micro-benchmarks (pytest-benchmark), next to a plain memory copy of the same size.

    pytest bench/test_codec_speed.py                         # 1M, 4M, 16M, 64M elements
    COMPCOMM_BENCH_SIZES=1M,16M pytest bench/test_codec_speed.py
    COMPCOMM_BENCH_DEVICES=cuda pytest bench/test_codec_speed.py    # default: cpu, and cuda if present
    pytest bench/test_codec_speed.py --benchmark-json out.json

Every kernel reports GB/s as (bytes of the fp32 tensor it processes) / (median time), in
`extra_info["GBps"]`; a summary table at the end gives each as a fraction of the copy's GB/s,
measured in the same run. Not part of the test suite (its testpaths is tests/).

    copy           dst.copy_(src), N fp32
    scan           codec.worker_scan: v = x + error, bits = sign(v), sum(v^2) (worker pass 1)
    update         codec.error_update_: error <- v - s sign(v) (worker pass 2)
    update_out     the same into another buffer, error unchanged (the optimizers' error_feedback_out)
    compress       scan + update: the whole worker side, compress and error update
    server         codec.server_scan_ + error_update_: a served chunk of N elements, 4 ranks
    decode         codec.decode: N fp32 outputs from N/8 bytes and a scale

On CPU the kernels are the fused C ones when built (see `codec.codec_info()`), else
torch; on CUDA the fused cupy ones when cupy is installed, else torch; the copy runs on the
same device, so on a GPU the fractions are of the device's measured memory bandwidth.
"""

from __future__ import annotations

import os
import re

import pytest
import torch

from compcomm import codec

SERVER_RANKS = 4
ROUNDS = int(os.environ.get("COMPCOMM_BENCH_ROUNDS", "5"))


def _parse_count(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)\s*", text, re.I)
    if not m:
        raise ValueError(f"bad element count {text!r} in COMPCOMM_BENCH_SIZES (e.g. 1M,16M)")
    return int(m.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30}[m.group(2).upper()]


SIZES = [_parse_count(s) for s in os.environ.get("COMPCOMM_BENCH_SIZES", "1M,4M,16M,64M").split(",")]
KERNELS = ["copy", "scan", "update", "update_out", "compress", "server", "decode"]
DEVICES = os.environ.get("COMPCOMM_BENCH_DEVICES", "cpu,cuda" if torch.cuda.is_available() else "cpu").split(",")


def _label(n: int) -> str:
    return f"{n >> 20}M" if n % (1 << 20) == 0 else str(n)


def _setup(kernel: str, n: int, device: str):
    """A no-argument callable running `kernel` once on n fp32 elements on `device` (and
    waiting for it there)."""
    run = _kernel(kernel, n, torch.device(device))
    if device == "cpu":
        return run
    return lambda: (run(), torch.cuda.synchronize(device))


def _kernel(kernel: str, n: int, device: torch.device):
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=gen).to(device)
    if kernel == "copy":
        dst = torch.empty_like(x)
        return lambda: dst.copy_(x)
    coder = codec.codec_for(device)
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
        out = torch.empty(n, device=device)
        return lambda: coder.decode(bits, 0.5, out)
    if kernel == "server":
        received = torch.randint(0, 256, (SERVER_RANKS, n // 8), dtype=torch.uint8, generator=gen).to(device)
        scales = (torch.rand(SERVER_RANKS, generator=gen) + 0.5).to(device)
        return lambda: (
            coder.server_scan_(received, scales, SERVER_RANKS, error, n, bits),
            coder.error_update_(error, 0.5, n),
        )
    raise ValueError(kernel)


@pytest.mark.parametrize("n", SIZES, ids=_label)
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("device", DEVICES)
def test_codec_speed(benchmark, gbps_table, device, kernel, n):
    fn = _setup(kernel, n, device)
    benchmark.group = f"codec {device} {_label(n)} fp32 elements"
    benchmark.extra_info.update(device=device, kernel=kernel, elements=n, bytes=4 * n)
    benchmark.pedantic(fn, rounds=ROUNDS, warmup_rounds=1, iterations=1)
    stats = getattr(benchmark, "stats", None)
    if stats is not None:  # None under --benchmark-disable
        median = stats.stats.median
        benchmark.extra_info["GBps"] = 4 * n / median / 1e9
        gbps_table[(device, kernel, n)] = benchmark.extra_info["GBps"]

"""Codec micro-benchmarks (pytest-benchmark), next to a plain memory copy of the same size.

    pytest bench/test_codec_speed.py                         # 1M, 4M, 16M, 64M elements
    COMPCOMM_BENCH_SIZES=1M,16M pytest bench/test_codec_speed.py
    pytest bench/test_codec_speed.py --benchmark-json out.json

Every kernel reports GB/s as (bytes of the fp32 tensor it processes) / (median time), in
`extra_info["GBps"]`; a summary table at the end gives each as a fraction of the copy's GB/s,
measured in the same run. Not part of the test suite (its testpaths is tests/).

    copy           dst.copy_(src), N fp32
    compress       codec.compress_: error += x, bits = packbits(error >= 0), error -= s * sign
    pack           codec.pack_signs of an N-element bool mask
    decode         codec.decode: N fp32 outputs from N/8 bytes and a scale
    server_reduce  codec.server_reduce_: a served chunk of N elements from 4 ranks' bits
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
KERNELS = ["copy", "compress", "pack", "decode", "server_reduce"]


def _label(n: int) -> str:
    return f"{n >> 20}M" if n % (1 << 20) == 0 else str(n)


def _setup(kernel: str, n: int):
    """A no-argument callable running `kernel` once on n fp32 elements."""
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=gen)
    if kernel == "copy":
        dst = torch.empty_like(x)
        return lambda: dst.copy_(x)
    if kernel == "compress":
        error = torch.zeros(n)
        bits = torch.empty(n // 8, dtype=torch.uint8)
        return lambda: codec.compress_(error, 1.0, bits, n, addend=x)
    if kernel == "pack":
        mask = x >= 0
        bits = torch.empty(n // 8, dtype=torch.uint8)
        return lambda: codec.pack_signs(mask, bits)
    if kernel == "decode":
        bits = torch.randint(0, 256, (n // 8,), dtype=torch.uint8, generator=gen)
        scale = torch.tensor(0.5)
        out = torch.empty(n)
        return lambda: codec.decode(bits, scale, out)
    if kernel == "server_reduce":
        bits = torch.randint(0, 256, (SERVER_RANKS, n // 8), dtype=torch.uint8, generator=gen)
        scales = torch.rand(SERVER_RANKS, generator=gen) + 0.5
        error = torch.zeros(n)
        return lambda: codec.server_reduce_(bits, scales, SERVER_RANKS, error, n)
    raise ValueError(kernel)


@pytest.mark.parametrize("n", SIZES, ids=_label)
@pytest.mark.parametrize("kernel", KERNELS)
def test_codec_speed(benchmark, gbps_table, kernel, n):
    fn = _setup(kernel, n)
    benchmark.group = f"codec {_label(n)} fp32 elements"
    benchmark.extra_info.update(kernel=kernel, elements=n, bytes=4 * n)
    benchmark.pedantic(fn, rounds=ROUNDS, warmup_rounds=1, iterations=1)
    stats = getattr(benchmark, "stats", None)
    if stats is not None:  # None under --benchmark-disable
        median = stats.stats.median
        benchmark.extra_info["GBps"] = 4 * n / median / 1e9
        gbps_table[(kernel, n)] = benchmark.extra_info["GBps"]

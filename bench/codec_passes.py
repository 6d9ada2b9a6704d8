"""The codec passes of one compressed allreduce, each callable alone, on realistic buffers.

A call over n ranks on N fp32 elements makes four passes over memory on each rank (the byte
counts are bench/collective_model.py's `flat_bytes`): the worker scan (with the worker error in
the x' form, as an ErrorFeedback reduced in place holds it: it reads x and the previous x' and
writes the new one), the server pass over the n received sign rows, the server error update and
the decode of the whole output. A fifth, the worker error update, is what an ErrorFeedback with
`double_buffer=False` makes instead of writing x'. bench/phases.py times them inside a
multi-rank run; bench/allreduce_bw.py times them alone to predict what the collective would do on
other links.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch

from compcomm import codec
from compcomm.layout import chunk_size, padded_size, real_count

PASSES = ("scan", "werr", "server", "serr", "decode")


def codec_passes(numel: int, n: int, rank: int = 0) -> dict[str, Callable[[], object]]:
    """Each pass of rank `rank`'s part of an n-rank call on `numel` fp32 elements, ready to run."""
    m, c = padded_size(numel, n), chunk_size(numel, n)
    coder = codec.codec_for(torch.device("cpu"))
    served = real_count(rank, numel, n)
    x = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
    worker, server, out, x_prime = torch.zeros(m), torch.zeros(c), torch.empty(m), torch.empty(m)
    signs = torch.zeros(n, c // 8, dtype=torch.uint8)
    received = torch.randint(0, 256, (n, c // 8), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
    scales = torch.ones(n)
    mine = torch.zeros(4 + c // 8, dtype=torch.uint8)
    everyone = torch.zeros(n, mine.numel(), dtype=torch.uint8)

    def decode() -> None:
        for j in range(n):
            coder.decode(everyone[j, 4:], 1.0, out[j * c : (j + 1) * c])

    return {
        "scan": lambda: coder.worker_scan(x, worker, signs.view(-1), 1.0, x_prime),
        "werr": lambda: coder.error_update_(worker, 1.0, numel, x),
        "server": lambda: coder.server_scan_(received, scales, n, server, served, mine[4:]),
        "serr": lambda: coder.error_update_(server, 1.0, served),
        "decode": decode,
    }


def time_passes(numel: int, n: int, repeats: int = 5) -> dict[str, float]:
    """The median seconds of each pass, run alone in this process."""
    passes = codec_passes(numel, n)
    times: dict[str, list[float]] = {name: [] for name in PASSES}
    for run in passes.values():
        run()  # fault the pages in
    for _ in range(repeats):
        for name, run in passes.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return {name: float(np.median(values)) for name, values in times.items()}

#!/usr/bin/env python3
"""gloo's all-gather against an all-to-all of n copies, per message size: what sets
`DIRECT_GATHER_BYTES` in compcomm's gloo backend.

    python bench/gather_latency.py                                   # 4 local gloo ranks
    python bench/netsim.py --hosts 4 --rate 10gbit -- python bench/gather_latency.py

Both move the same bytes per rank ((n - 1) messages). gloo's all-gather passes each message round
a ring, n - 1 steps of one latency each; the all-to-all sends the rank's message straight to every
other rank at once. Times are torch.distributed's own primitives (no compcomm), the median over
--iters calls, each started from a barrier; rank 0 prints one line per size.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from convergence import run_parsed  # noqa: E402  (the benchmark beside this file: launch or spawn ranks)

SIZES = (2 * 1024, 8 * 1024, 32 * 1024, 128 * 1024, 512 * 1024, 2 * 1024 * 1024)


def timed(fn, iters: int) -> float:
    """Median milliseconds of fn() over `iters` calls, each from a barrier."""
    times = []
    for _ in range(iters):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def measure(iters: int) -> list[tuple[int, float, float]]:
    n = dist.get_world_size()
    rows = []
    for size in SIZES:
        mine = torch.full((size,), dist.get_rank(), dtype=torch.uint8)
        out = torch.empty(n * size, dtype=torch.uint8)

        def gather() -> None:
            dist.all_gather_into_tensor(out, mine)

        def direct() -> None:
            dist.all_to_all_single(out, mine.view(1, -1).expand(n, -1).contiguous().view(-1))

        gather(), direct()  # connections and buffers warm
        rows.append((size, timed(gather, iters), timed(direct, iters)))
    return rows


def rank_main(args: argparse.Namespace) -> list[tuple[int, float, float]]:
    torch.set_num_threads(1)
    return measure(args.iters)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=30, help="calls per size and primitive (default 30)")
    rows, args, label = run_parsed(p, rank_main, argv)
    if rows is None:  # not rank 0
        return 0
    print(f"# gather_latency: {label}, median of {args.iters} calls")
    print(f"# {'bytes/rank':>10} {'all_gather(ms)':>15} {'all_to_all(ms)':>15} {'ratio':>6}")
    for size, ring, straight in rows:
        print(f"  {size:>10} {ring:>15.2f} {straight:>15.2f} {ring / straight:>6.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Bandwidth of the byte collectives among the ranks of one host: shared memory against gloo.

    python bench/intra_bw.py --nprocs 2                  # spawns 2 local ranks
    python bench/intra_bw.py --nprocs 4 --sizes 1M,16M,100M --json out.json

The transports a hierarchical backend can use inside a node (`intra="shm"` or `"gloo"`, which
sends through loopback TCP), timed per collective on the same ranks and buffers. `size` is the
collective's whole buffer, as nccl-tests counts it: the all-gather's output (each rank sends
size/n), the all-to-all's input, the all-reduce's tensor (fp32, op sum). A call's time is the
slowest rank's, averaged over --iters calls after --warmup; algbw = size / time, busbw = algbw x
(n-1)/n (all-gather, all-to-all) or x 2(n-1)/n (all-reduce). The last column is gloo's time over
shm's for the same collective and size.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.distributed as dist

from ranks import add_nprocs_argument, gather_floats, run_ranks, set_threads
from records import output_path, write_json
from units import human, parse_size

COLLECTIVES = ("all_gather", "all_to_all", "all_reduce")
TRANSPORTS = ("shm", "gloo")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1M,16M,100M", help="comma-separated buffer sizes (default 1M,16M,100M)")
    p.add_argument("-n", "--iters", type=int, default=5, help="timed calls per row (default 5)")
    p.add_argument("-w", "--warmup", type=int, default=2, help="untimed calls first (default 2)")
    add_nprocs_argument(p)
    p.add_argument("--json", metavar="PATH", type=output_path, help="write the rows as a JSON list")
    return p


def _call(be, collective: str, size: int):
    """A function making one call of `collective` on `size` bytes (buffers made once)."""
    n = be.world_size
    if collective == "all_gather":
        send, recv = torch.ones(size // n, dtype=torch.uint8), torch.empty(n, size // n, dtype=torch.uint8)
        return lambda: be.all_gather(send, recv)
    if collective == "all_to_all":
        send, recv = torch.ones(n, size // n, dtype=torch.uint8), torch.empty(n, size // n, dtype=torch.uint8)
        return lambda: be.all_to_all(send, recv)
    tensor = torch.ones(size // 4)
    return lambda: be.all_reduce(tensor, "sum")


def _time(be, call, iters: int, warmup: int) -> float:
    """Seconds per call, as the slowest rank saw them."""
    for _ in range(warmup):
        call()
    be.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        call()
    return float(gather_floats(be, (time.perf_counter() - start) / iters).max())


def run(args: argparse.Namespace) -> list[dict]:
    from compcomm import backends

    set_threads(dist.get_world_size())  # an even share of the cores: more threads would spin against peers
    made = {name: backends.get(name) for name in TRANSPORTS}
    n = made["shm"].world_size
    rows = []
    for size in [parse_size(s) for s in args.sizes.split(",")]:
        size -= size % (4 * n)
        for collective in COLLECTIVES:
            times = {name: _time(be, _call(be, collective, size), args.iters, args.warmup) for name, be in made.items()}
            factor = (2 if collective == "all_reduce" else 1) * (n - 1) / n
            for name, seconds in times.items():
                rows.append(
                    {
                        "collective": collective,
                        "transport": name,
                        "world_size": n,
                        "size_bytes": size,
                        "time_us": seconds * 1e6,
                        "algbw_GBps": size / seconds / 1e9,
                        "busbw_GBps": size / seconds / 1e9 * factor,
                        "gloo_over_shm": times["gloo"] / times["shm"],
                    }
                )
    return rows


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    rows, n = run_ranks(run, args, args.nprocs)
    assert rows is not None
    print(f"# intra_bw: {n} ranks on this host, iters {args.iters}, warmup {args.warmup}")
    head = f"{'collective':>10} {'size':>9} {'transport':>9} | {'time(us)':>11} {'algbw(GB/s)':>11} {'busbw(GB/s)':>11}"
    print(f"# {head}")
    for r in rows:
        ratio = f"  gloo/shm {r['gloo_over_shm']:.2f}x" if r["transport"] == "gloo" else ""
        print(
            f"  {r['collective']:>10} {human(r['size_bytes']):>9} {r['transport']:>9} | {r['time_us']:>11.1f} "
            f"{r['algbw_GBps']:>11.3f} {r['busbw_GBps']:>11.3f}{ratio}"
        )
    if args.json:
        write_json(rows, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())

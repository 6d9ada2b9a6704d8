#!/usr/bin/env python3
"""Where the time of one compressed allreduce goes, phase by phase, for the cost model.

    python bench/netsim.py --hosts 4 --rate 1gbit -- python bench/phases.py --sizes 1M,100M --json out.json
    python bench/phases.py --nprocs 4                            # spawns 4 local gloo ranks
    mpirun -n 4 python bench/phases.py                           # mpirun's ranks, one gloo group

Runs under torchrun or bench/netsim.py, under mpirun, or plainly, spawning --nprocs local ranks
(bench/ranks.py). For every size it times, on all ranks at once, each part of the flat 1-bit
collective on its own, then the whole call:

    header    phase 0: all-to-all of a 16-byte header + min(C/8, FOLD_BYTES / n) bytes of signs per peer
    scan      worker pass: reads x and the previous x' (N elements), writes the new x' and packs
              its signs (the x' form of an ErrorFeedback reduced in place)
    a2a       phase 1: all-to-all of the rest of the packed signs (none when C/8 <= FOLD_BYTES / n)
    werr      worker error update: reads x and the error, writes the error (N elements): what
              an ErrorFeedback(double_buffer=False) makes instead, overlapping a2a; not in `call`
    server    server pass: n rows of C/8 sign bytes and the server error -> y, its signs
    gather    phase 2: all-gather of each server's (t_j, signs), (n-1) blocks of 4 + C/8 bytes
    serr      server error update (C elements)
    decode    writes the M-element output from the n gathered chunks
    call      compressed_allreduce over the group (the phases above but werr, serr overlapping
              gather)
    allreduce the uncompressed fp32 all_reduce (the baseline)

and with K > 1 ranks per host (LOCAL_WORLD_SIZE; self-spawned ranks are all on one host), for the
hierarchical backend:

    rs        the node's step as the hierarchical schedule runs it: (K-1) blocks of 4N/K fp32
              bytes exchanged inside the host (and for K > 2 the first K-1 blocks summed); the
              last block's sum and the division by K run inside the worker scan of `hier`
    share     the all-gather of the parts' phase-2 bytes inside the host, (K-1) blocks of ~N/(8K)
    hier      compressed_allreduce over the hierarchical backend

Every rank runs each part at once, so the codec passes share the machine's cores as they do in
a real call. Each figure is the median over --iters calls of the slowest rank (a barrier first);
a first untimed round over the smallest size opens the connections.
The records (`--json`) feed bench/cost_model.py, which fits latency, link bandwidth and codec
memory bandwidth to the parts and predicts the whole call and the baseline.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

from codec_passes import codec_passes
from emulation import emulated, label, record_fields
from ranks import add_nprocs_argument, gather_floats, launched_world, run_ranks, set_threads
from records import codec_line, output_path, write_json
from units import parse_size

PARTS = ("header", "scan", "a2a", "werr", "server", "gather", "serr", "decode", "call", "allreduce")
NODE_PARTS = ("rs", "share", "hier")  # with several ranks per host (LOCAL_WORLD_SIZE > 1)


def _timed(be, fn) -> float:
    """The slowest rank's time of one call of fn, in seconds (after a barrier)."""
    be.barrier()
    start = time.perf_counter()
    fn()
    return emulated(float(gather_floats(be, time.perf_counter() - start).max()))


def measure(be, numel: int, iters: int, parts: list[str], hier=None) -> dict:
    """One record: every part's time for a `numel`-element fp32 tensor on this group."""
    import compcomm
    from compcomm.agreement import FOLD_BYTES, HEADER
    from compcomm.backends.rank_order import sum_in_rank_order
    from compcomm.layout import chunk_size

    n, rank = be.world_size, be.rank
    c = chunk_size(numel, n)
    x = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
    buf = x.clone()
    ef = compcomm.ErrorFeedback()
    mine = torch.zeros(4 + c // 8, dtype=torch.uint8)
    everyone = torch.zeros(n, mine.numel(), dtype=torch.uint8)
    room = min(FOLD_BYTES // n, c // 8)  # a repeated call's room in phase 0
    header = torch.zeros(n, HEADER.itemsize + room, dtype=torch.uint8)
    headers = torch.empty_like(header)
    rest = torch.zeros(n, c // 8 - room, dtype=torch.uint8)
    rest_received = torch.empty_like(rest)

    calls = {
        **codec_passes(numel, n, rank),
        "header": lambda: be.all_to_all(header, headers),
        "a2a": lambda: rest.numel() and be.all_to_all(rest, rest_received),
        "gather": lambda: be.all_gather(mine, everyone),
        "call": lambda: compcomm.compressed_allreduce(buf, ef, backend=be),
        "allreduce": lambda: be.all_reduce(buf, "mean"),
    }
    if hier is not None:
        k = hier.intra.world_size
        size = chunk_size(numel, k)
        result = torch.zeros(
            hier.inter.world_size * (4 + chunk_size(size, hier.inter.world_size) // 8), dtype=torch.uint8
        )
        results = torch.empty(k, result.numel(), dtype=torch.uint8)
        ef_hier = compcomm.ErrorFeedback()

        def node_step(blocks: list[torch.Tensor], part: torch.Tensor) -> None:
            if len(blocks) > 2:
                sum_in_rank_order(blocks[:-1], part)

        calls.update(
            {
                "rs": lambda: hier.exchange_in_node(x, size, torch.float32, node_step),
                "share": lambda: hier.intra.all_gather(result, results),
                "hier": lambda: compcomm.compressed_allreduce(buf, ef_hier, backend=hier),
            }
        )
    record = {
        "world_size": n,
        "numel": numel,
        "size_bytes": 4 * numel,
        "chunk": c,
        "ranks_per_host": int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        "rate": os.environ.get("NETSIM_RATE", ""),
        "threads": torch.get_num_threads(),
        **record_fields(),
    }
    for part in parts:
        buf.copy_(x)
        calls[part]()  # warm-up (and the first call sizes the error buffers)
    times: dict[str, list[float]] = {part: [] for part in parts}
    for _ in range(iters):  # round-robin, so that a burst of load elsewhere hits every part alike
        for part in parts:
            times[part].append(_timed(be, calls[part]))
    record.update({part + "_s": float(np.median(times[part])) for part in parts})
    return record


def sizes_argument(text: str) -> list[int]:
    """argparse type of --sizes: the sizes in bytes, each at least one fp32 element, read before
    any rank starts (a bad one failed on every rank, in a traceback each)."""
    sizes = [parse_size(size) for size in text.split(",") if size.strip()]
    if not sizes:
        raise argparse.ArgumentTypeError(f"{text!r} names no size; give e.g. 1M,10M,100M")
    small = [size for size in sizes if size < 4]
    if small:
        raise argparse.ArgumentTypeError(f"{small[0]} bytes is less than one fp32 element (4 bytes)")
    return sizes


def time_parts(args: argparse.Namespace) -> None:
    """Every rank, in the gloo group: the parts at each size; rank 0 prints a row per size (the
    size timed: whole fp32 elements) and writes the records."""
    from compcomm import backends

    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    set_threads(local)
    be = backends.get("gloo")
    hier = backends.get("hierarchical") if local > 1 else None
    parts = args.parts + ([part for part in NODE_PARTS if part not in args.parts] if hier is not None else [])
    rank = dist.get_rank()
    if rank == 0:
        print(codec_line(), flush=True)
        if label():
            print(f"# times: {label()} (bench/netsim.py --cpus-per-host, time dilation)", flush=True)
    measure(be, min(args.sizes) // 4, 1, parts, hier)  # connections and caches warm
    records: list[dict] = []
    for size in args.sizes:
        record = measure(be, size // 4, args.iters, parts, hier)
        records.append(record)
        if rank == 0:
            cells = " ".join(f"{part} {record[part + '_s'] * 1e3:9.2f}" for part in parts)
            print(f"n {record['world_size']:>3} size {record['size_bytes']:>10} | ms: {cells}", flush=True)
    if rank == 0 and args.json:
        write_json(records, args.json)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--sizes",
        type=sizes_argument,
        default="1M,10M,100M",
        help="comma-separated fp32 sizes in bytes, at least 4 (default 1M,10M,100M)",
    )
    p.add_argument("--iters", type=int, default=5, help="timed calls per part (default 5)")
    p.add_argument("--parts", default=",".join(PARTS), help=f"parts to time (default {','.join(PARTS)})")
    add_nprocs_argument(p)
    p.add_argument("--json", metavar="PATH", type=output_path, help="write the records as a JSON list")
    args = p.parse_args(argv)
    if args.iters < 1:
        p.error(f"--iters must be >= 1, got {args.iters}")
    args.parts = [part for part in args.parts.split(",") if part]
    if not args.parts:
        p.error(f"--parts names no part; choose from {', '.join(PARTS + NODE_PARTS)}")
    unknown = set(args.parts) - set(PARTS) - set(NODE_PARTS)
    if unknown:
        p.error(f"unknown parts {sorted(unknown)}; choose from {', '.join(PARTS + NODE_PARTS)}")
    launched = launched_world()  # under mpirun, this sets LOCAL_WORLD_SIZE from MPI's world
    per_host = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if launched is not None else args.nprocs
    if per_host < 2 and set(args.parts) & set(NODE_PARTS):
        p.error(f"{', '.join(NODE_PARTS)} time the hierarchical call: they need several ranks per host")
    run_ranks(time_parts, args, args.nprocs)
    return 0


if __name__ == "__main__":
    sys.exit(main())

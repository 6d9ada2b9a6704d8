#!/usr/bin/env python3
"""Soak: many async compressed calls interleaved with the caller's own collectives on one group.

    python bench/soak.py [--calls 10000] [--nprocs 4] [--numel 4096] [--json PATH]

Each rank loops: submit `compressed_allreduce(..., async_op=True)`, run its own
`torch.distributed.all_reduce` on the same group while that call is in flight, every tenth
iteration also a synchronous compressed call through a second backend object over the same group
and a bad call (NaN on one rank) that must raise NonFiniteError everywhere, then wait. It checks
every result is bitwise equal across ranks and records resident memory (RSS) and the number of
threads every `--every` calls. Exits non-zero if a check fails, RSS grows by more than
`--max-rss-growth-mib` after the first checkpoint, or the thread count changes after it.
Runs plainly (self-spawned local gloo ranks) or under torchrun.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import sys
import threading
import time

import torch
import torch.distributed as dist

import compcomm

from ranks import add_nprocs_argument, run_ranks
from records import output_path, write_json


def rss_mib() -> float:
    """Resident set size of this process, from /proc (Linux)."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def soak(args: argparse.Namespace) -> list[dict]:
    rank, world = dist.get_rank(), dist.get_world_size()
    first, second = compcomm.backends.get("gloo"), compcomm.backends.get("gloo")
    ef_async = compcomm.ErrorFeedback(tag="async")
    ef_sync = compcomm.ErrorFeedback(tag="sync")
    gen = torch.Generator().manual_seed(rank)
    records, started = [], time.perf_counter()
    for call in range(1, args.calls + 1):
        x = torch.randn(args.numel, generator=gen)
        handle = compcomm.compressed_allreduce(x, ef_async, backend=first, async_op=True)
        own = torch.full((16,), float(call))
        dist.all_reduce(own)
        if call % 10 == 0:
            y = torch.randn(args.numel // 2, generator=gen)
            compcomm.compressed_allreduce(y, ef_sync, backend=second)
            bad = torch.randn(args.numel // 4, generator=gen)
            if rank == call % world:
                bad[0] = float("nan")
            try:
                compcomm.compressed_allreduce(bad, compcomm.ErrorFeedback(tag="bad"), backend=first)
                raise SystemExit(f"rank {rank}: call {call}: a NaN input did not raise")
            except compcomm.NonFiniteError:
                pass
        handle.wait()
        if own[0].item() != world * call:
            raise SystemExit(f"rank {rank}: call {call}: the caller's own all_reduce was corrupted")
        if call % args.every == 0:
            digest = hashlib.sha1(x.numpy().tobytes()).digest()
            digests = [None] * world
            dist.all_gather_object(digests, digest)
            if len(set(digests)) != 1:
                raise SystemExit(f"rank {rank}: call {call}: results differ between ranks")
            records.append(
                {
                    "calls": call,
                    "rank": rank,
                    "rss_mib": round(rss_mib(), 1),
                    "threads": threading.active_count(),
                    "seconds": round(time.perf_counter() - started, 2),
                }
            )
    return records


def check(records: list[dict], args: argparse.Namespace) -> list[str]:
    base = records[0]
    problems = []
    for rec in records[1:]:
        if rec["rss_mib"] - base["rss_mib"] > args.max_rss_growth_mib:
            problems.append(
                f"rank {rec['rank']}: RSS grew {rec['rss_mib'] - base['rss_mib']:.1f} MiB by call {rec['calls']}"
            )
        if rec["threads"] != base["threads"]:
            problems.append(
                f"rank {rec['rank']}: {rec['threads']} threads at call {rec['calls']}, "
                f"{base['threads']} at {base['calls']}"
            )
    return problems


def run_rank(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    records = soak(args)
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, records)
    problems = [p for recs in everyone for p in check(recs, args)]
    if dist.get_rank() == 0:
        print(
            f"# soak: {args.calls} async compressed calls of {args.numel} fp32 elements on "
            f"{dist.get_world_size()} gloo ranks, each overlapped with the caller's own all_reduce"
        )
        print(f"# {'calls':>7} {'rank':>4} {'rss(MiB)':>9} {'threads':>7} {'time(s)':>8}")
        for recs in everyone:
            for rec in recs:
                print(
                    f"  {rec['calls']:>7} {rec['rank']:>4} {rec['rss_mib']:>9.1f} {rec['threads']:>7} "
                    f"{rec['seconds']:>8.2f}"
                )
        print("# result: " + ("clean" if not problems else "; ".join(problems)))
        if args.json:
            write_json(
                {
                    "calls": args.calls,
                    "numel": args.numel,
                    "world_size": dist.get_world_size(),
                    "records": [r for recs in everyone for r in recs],
                    "problems": problems,
                },
                args.json,
            )
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=10_000)
    p.add_argument(
        "--numel", type=int, default=4096, help="elements per call (at least 4: every tenth call sends numel / 4)"
    )
    p.add_argument("--every", type=int, default=1000, help="record RSS and threads every this many calls")
    add_nprocs_argument(p)
    p.add_argument("--max-rss-growth-mib", type=float, default=20.0)
    p.add_argument("--json", metavar="PATH", type=output_path)
    args = p.parse_args(argv)
    # Refused here, before any rank starts: a bad value would fail on one rank and leave the
    # others hanging or failing for another reason, or pass every check vacuously.
    for flag, least in (("every", 1), ("numel", 4)):
        if getattr(args, flag) < least:
            p.error(f"--{flag} must be at least {least}, got {getattr(args, flag)}")
    if not (math.isfinite(args.max_rss_growth_mib) and args.max_rss_growth_mib >= 0):
        p.error(f"--max-rss-growth-mib must be a finite number of MiB, at least 0, got {args.max_rss_growth_mib}")
    if args.calls < args.every:
        p.error("--calls must be at least --every")
    code, _ = run_ranks(run_rank, args, args.nprocs)
    return code or 0  # every rank checked every rank's records: rank 0's verdict is everyone's


if __name__ == "__main__":
    sys.exit(main())

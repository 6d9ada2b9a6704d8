#!/usr/bin/env python3
"""One real compressed allreduce, rank by rank: when each codec kernel and each collective of the
call started and ended. `bench/phases.py` times every part alone, from a barrier; this shows how
the parts of one call line up across ranks, and how long ranks wait on each other.

    python bench/trace_call.py --size 25M                                    # 4 local gloo ranks
    python bench/netsim.py --hosts 4 --rate 1gbit -- python bench/trace_call.py --size 25M

The codec's methods and the backend's collectives are wrapped to stamp their start and end
(milliseconds from the barrier before the call); `a2a`/`gather` end when the collective was
started, `a2a_wait`/`gather_wait` when the caller waited for one in flight. The first `a2a` is
phase 0 (the headers and the first sign bytes, waited for at once: it ends when the slowest rank
has sent), a second one phase 1 (none when phase 0 carried every row). After --warmup calls,
the traced call runs from a barrier; rank 0 prints every rank's line.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from allreduce_bw import parse_size  # noqa: E402  (the benchmarks beside this file)
from convergence import run_parsed  # noqa: E402

KERNELS = {"worker_scan": "scan", "error_update_": "update", "server_scan_": "server", "decode": "decode"}
COLLECTIVES = {"all_to_all": "a2a", "all_gather": "gather"}


class Stamps:
    """(label, start ms, end ms) of every wrapped call since `start()`."""

    def __init__(self) -> None:
        self.events: list[tuple[str, float, float]] = []
        self.origin = time.perf_counter()

    def start(self) -> None:
        self.events.clear()
        self.origin = time.perf_counter()

    def timed(self, label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def stamped(*args: Any, **kwargs: Any) -> Any:
            begin = time.perf_counter()
            result = fn(*args, **kwargs)
            self.events.append((label, 1e3 * (begin - self.origin), 1e3 * (time.perf_counter() - self.origin)))
            if kwargs.get("async_op") is True or (len(args) > 2 and args[2] is True):  # (send, recv, async_op)
                return _StampedHandle(result, self.timed(f"{label}_wait", result.wait))
            return result

        return stamped


class _StampedHandle:
    """A collective in flight whose wait() is stamped."""

    def __init__(self, handle: Any, wait: Callable[[], Any]) -> None:
        self._handle, self.wait = handle, wait

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handle, name)


def rank_main(args: argparse.Namespace) -> list[tuple[float, list[tuple[str, float, float]]]]:
    import compcomm
    from compcomm import codec
    from compcomm.backends import resolve

    torch.set_num_threads(1)
    be = resolve(None)
    stamps = Stamps()
    coder = codec.codec_for("cpu")
    for method, label in KERNELS.items():
        setattr(coder, method, stamps.timed(label, getattr(coder, method)))
    for method, label in COLLECTIVES.items():
        setattr(be, method, stamps.timed(label, getattr(be, method)))
    x = torch.randn(args.size // 4, generator=torch.Generator().manual_seed(dist.get_rank()))
    buf, ef = x.clone(), compcomm.ErrorFeedback()
    for _ in range(args.warmup):
        buf.copy_(x)
        compcomm.compressed_allreduce(buf, ef, backend=be)
    buf.copy_(x)
    be.barrier()
    stamps.start()
    compcomm.compressed_allreduce(buf, ef, backend=be)
    total = 1e3 * (time.perf_counter() - stamps.origin)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (total, stamps.events))
    return everyone


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=parse_size, default=parse_size("25M"), help="fp32 bytes per rank (default 25M)")
    p.add_argument("--warmup", type=int, default=5, help="untraced calls first (default 5)")
    everyone, args, label = run_parsed(p, rank_main, argv)
    if everyone is None:  # not rank 0
        return 0
    print(f"# trace_call: {label}, {args.size} bytes of fp32, ms from the barrier")
    for rank, (total, events) in enumerate(everyone):
        parts = ", ".join(f"{name} {begin:.1f}-{end:.1f}" for name, begin, end in events)
        print(f"rank {rank} call {total:.1f} | {parts}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

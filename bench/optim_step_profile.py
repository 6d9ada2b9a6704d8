#!/usr/bin/env python3
"""Where a compcomm optimizer's training step spends its time, on bench/train_step.py's model.

    python bench/optim_step_profile.py --methods onebit_adam,onebit_lamb,zeroone_adam

Trains each method as bench/train_step.py does (same model, data, ranks: 4 self-spawned gloo
ranks, one thread each, or under torchrun / bench/netsim.py) and profiles rank 0's steps of the
compression stage with torch.profiler. Per step (mean over the profiled steps) it prints the
wall time of forward + backward and of `step()`, the CPU time of the optimizer's own regions
(`compcomm.optim.payload`: filling the buckets, during backward; `submit`: starting each bucket's
collective; `wait`: step() waiting for the collectives
and the verdict; `update`: the update rule), the collectives' busy and hidden time
(`last_comm_timing`), and the aten operators that took the most CPU time in the main thread.
The collectives' own codec work runs on the channel's worker thread in native code, which the
profiler does not see as operators: it shows as `wait`, and as the busy time.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_step as ts  # noqa: E402  (the benchmark beside this file: model, data, methods)
from convergence import run_ranks  # noqa: E402

REGIONS = ("payload", "submit", "wait", "update")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", default="onebit_adam,onebit_lamb,zeroone_adam")
    ap.add_argument("--steps", type=int, default=12, help="steps per method (default 12)")
    ap.add_argument("--warmup-steps", type=int, default=5)
    ap.add_argument("--profiled", type=int, default=4, help="last steps profiled (default 4)")
    ap.add_argument("--world-size", type=int, default=4, help="local ranks to spawn (ignored under torchrun)")
    return ap.parse_args(argv)


def profile_method(name: str, args: argparse.Namespace) -> dict[str, float] | None:
    targs = ts.parse_args(["--steps", str(args.steps), "--warmup-steps", str(args.warmup_steps)])
    text = ts.load_text("char-mlp", targs.text_bytes)
    context, _, _, batch = targs.shape
    run = ts.METHODS[name](ts.make_model(targs), targs)
    gen = torch.Generator().manual_seed(targs.seed * 1_000_003 + dist.get_rank())
    first = args.steps - args.profiled
    walls = {"forward+backward": 0.0, "step": 0.0}
    busy = hidden = 0.0
    prof = profile(activities=[ProfilerActivity.CPU])
    for step in range(args.steps):
        seq = ts.windows(text, torch.randint(0, len(text) - context - 1, (batch,), generator=gen), context)
        dist.barrier()
        if step == first:
            prof.__enter__()
        t0 = time.perf_counter()
        run.optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(run.model(seq[:, :-1]), seq[:, -1]).backward()
        t1 = time.perf_counter()
        run.optimizer.step()
        t2 = time.perf_counter()
        if step >= first:
            walls["forward+backward"] += t1 - t0
            walls["step"] += t2 - t1
            timing = run.comm_timing()
            busy, hidden = busy + timing[0], hidden + timing[1]  # type: ignore[index]
    prof.__exit__(None, None, None)
    if dist.get_rank() != 0:
        return None
    n = args.profiled
    out = {k: 1e3 * v / n for k, v in walls.items()}
    out.update({"comm busy": 1e3 * busy / n, "comm hidden": 1e3 * hidden / n})
    events = prof.key_averages()
    for region in REGIONS:
        out[region] = sum(e.cpu_time_total for e in events if e.key == f"compcomm.optim.{region}") / 1e3 / n
    ops = sorted((e for e in events if e.key.startswith("aten::")), key=lambda e: -e.self_cpu_time_total)
    out.update({e.key: e.self_cpu_time_total / 1e3 / n for e in ops[:8]})
    return out


def rank_main(args: argparse.Namespace) -> list[tuple[str, dict[str, float]]] | None:
    ts._set_threads(dist.get_world_size())
    results = [(name, profile_method(name, args)) for name in args.methods.split(",") if name]
    return None if dist.get_rank() else [(n, r) for n, r in results if r is not None]


def report(results: list[tuple[str, dict[str, float]]], args: argparse.Namespace, world: int) -> None:
    print(
        f"# optim_step_profile: {world} ranks, rank 0, mean of the last {args.profiled} of {args.steps} steps "
        f"({args.warmup_steps} warm-up), ms per step (CPU time for regions and operators)"
    )
    for name, rec in results:
        print(f"== {name}")
        for key, value in rec.items():
            print(f"  {key:<28s} {value:8.1f}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    results, world = run_ranks(rank_main, args, args.world_size)
    if results is not None:  # rank 0, or the spawning process
        report(results, args, world)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()

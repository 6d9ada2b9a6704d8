"""Overlap of the optimizers' communication with backward: the same training steps with
`overlap = False` (every bucket's collective starts in `step()`, after backward) and with
`overlap = True` (each bucket starts as soon as its last gradient is accumulated), in one run.

An MLP of `--layers` square layers, one bucket per layer (`--bucket-mb`), each rank its own
batch; per variant, the median wall time of a whole step (forward, backward, `opt.step()`,
ranks aligned by a barrier before each step), in the warm-up stage (uncompressed gradients)
and in the compression stage (1-bit momenta). Parameters of both variants are compared at the
end: they must be bitwise equal. Per variant and stage it also reports the fraction of the
collectives' time hidden behind backward (the optimizer's `last_comm_timing`: time they ran
before backward ended over the time they ran, summed over the stage's steps, mean over ranks).

    python bench/optim_overlap.py                              # 4 local gloo ranks
    python bench/netsim.py --hosts 4 --rate 1gbit -- python bench/optim_overlap.py
    python bench/netsim.py --hosts 4 --rate 1gbit --cpus-per-host 1 -- python bench/optim_overlap.py

Under netsim's time dilation (`--cpus-per-host`) the step times are the emulated cluster's
(divided by d, `emulation`), and the table and records say so.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

import emulation
from ranks import add_nprocs_argument, run_ranks
from records import codec_line, output_path, write_json


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_nprocs_argument(ap, "--world-size")
    ap.add_argument("--optimizer", choices=["adam", "lamb", "zeroone"], default="adam")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--bucket-mb", type=float, default=4.0)
    ap.add_argument("--steps", type=int, default=8, help="timed steps per stage and variant")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--json", default=None, type=output_path, help="write the records here")
    args = ap.parse_args(argv)
    for flag in ("layers", "width", "batch", "steps", "threads"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag} must be at least 1, got {getattr(args, flag)}")
    if not args.bucket_mb > 0:
        ap.error(f"--bucket-mb must be positive, got {args.bucket_mb:g}")
    return args


def make(args: argparse.Namespace, overlap: bool, freeze: int):
    from compcomm.optim import OnebitAdam, OnebitLamb, ZeroOneAdam

    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(args.layers):
        layers += [torch.nn.Linear(args.width, args.width), torch.nn.Tanh()]
    model = torch.nn.Sequential(*layers)
    if args.optimizer == "adam":
        opt = OnebitAdam(model.parameters(), lr=1e-4, freeze_step=freeze)
    elif args.optimizer == "lamb":
        opt = OnebitLamb(model.parameters(), lr=1e-4, freeze_step=freeze)
    else:
        opt = ZeroOneAdam(model.parameters(), lr=1e-4, var_freeze_step=freeze, var_update_scaler=1)
    opt.bucket_bytes = int(args.bucket_mb * 2**20)
    opt.overlap = overlap
    return model, opt


def timed_steps(args: argparse.Namespace, overlap: bool) -> tuple[dict[str, float], dict[str, float], bytes, int]:
    """Median step time (ms) and fraction of collective time hidden behind backward, in warm-up
    and in the compression stage; final parameters; bytes sent."""
    rank = dist.get_rank()
    freeze = args.steps + 1
    model, opt = make(args, overlap, freeze)
    sent = opt.backend.bytes_sent
    times: dict[str, list[float]] = {"warmup": [], "compressed": []}
    comm: dict[str, list[float]] = {"warmup": [0.0, 0.0], "compressed": [0.0, 0.0]}  # busy, hidden
    for step in range(2 * args.steps + 2):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(args.batch, args.width, generator=g)
        dist.barrier()
        t0 = time.perf_counter()
        model.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()
        elapsed = emulation.emulated(time.perf_counter() - t0) * 1e3
        if step == 0 or step == freeze:  # the first backward builds the buckets; the freeze step
            continue
        stage = "warmup" if step < freeze else "compressed"
        times[stage].append(elapsed)
        comm[stage][0] += opt.last_comm_timing.busy
        comm[stage][1] += opt.last_comm_timing.hidden
    raw = b"".join(p.detach().numpy().tobytes() for p in model.parameters())
    sums = torch.tensor([v for stage in ("warmup", "compressed") for v in comm[stage]], dtype=torch.float64)
    dist.all_reduce(sums)  # over ranks: the fraction of the summed times
    hidden = {
        stage: float(sums[2 * i + 1] / sums[2 * i]) if sums[2 * i] > 0 else 0.0
        for i, stage in enumerate(("warmup", "compressed"))
    }
    medians = {k: statistics.median(v) for k, v in times.items()}
    return medians, hidden, raw, opt.backend.bytes_sent - sent


def rank_main(args: argparse.Namespace) -> list[dict[str, Any]]:
    torch.set_num_threads(args.threads)
    plain, hidden_plain, raw_plain, bytes_plain = timed_steps(args, overlap=False)
    overlapped, hidden_overlap, raw_overlap, bytes_overlap = timed_steps(args, overlap=True)
    # Parameters must match bit for bit. The bytes may not: phase 0 carries as many sign bytes as
    # the previous call needed, and overlap starts the buckets in another order.
    flags = torch.tensor([0.0 if raw_plain == raw_overlap else 1.0])
    dist.all_reduce(flags)
    world = dist.get_world_size()
    return [
        {
            "stage": stage,
            "optimizer": args.optimizer,
            "world_size": world,
            "params": args.layers * (args.width + 1) * args.width,
            "step_ms_no_overlap": plain[stage],
            "step_ms_overlap": overlapped[stage],
            "speedup": plain[stage] / overlapped[stage],
            "bitwise_equal_all_ranks": float(flags) == 0.0,
            "bytes_sent_no_overlap": bytes_plain,
            "bytes_sent_overlap": bytes_overlap,
            "comm_hidden_fraction_no_overlap": hidden_plain[stage],
            "comm_hidden_fraction_overlap": hidden_overlap[stage],
            **emulation.record_fields(),
        }
        for stage in ("warmup", "compressed")
    ]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    records, world = run_ranks(rank_main, args, args.world_size)
    if records is None:
        return
    print(
        f"# {args.optimizer}, {world} ranks, {args.layers}x{args.width}^2 MLP, batch {args.batch}, "
        f"buckets of {args.bucket_mb} MiB, median of {args.steps} steps"
    )
    print(codec_line())
    if emulation.label():
        print(f"# times: {emulation.label()} (bench/netsim.py --cpus-per-host, time dilation)")
    print(
        f"{'stage':>10s} | {'no overlap(ms)':>14s} {'overlap(ms)':>12s} {'speedup':>8s} | "
        f"{'comm hidden behind backward':>27s} | bitwise equal"
    )
    for r in records:
        hidden = (
            f"{100 * r['comm_hidden_fraction_overlap']:.0f}% "
            f"(no overlap: {100 * r['comm_hidden_fraction_no_overlap']:.0f}%)"
        )
        print(
            f"{r['stage']:>10s} | {r['step_ms_no_overlap']:14.1f} {r['step_ms_overlap']:12.1f} "
            f"{r['speedup']:7.2f}x | {hidden:>27s} | {r['bitwise_equal_all_ranks']}"
        )
    if args.json:
        write_json(records, args.json)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()

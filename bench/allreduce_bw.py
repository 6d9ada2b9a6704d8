#!/usr/bin/env python3
"""Bandwidth sweep of the compressed allreduce against the plain one, nccl-tests style.

    python bench/allreduce_bw.py                                  # spawns 4 local gloo ranks
    torchrun --nproc-per-node 4 bench/allreduce_bw.py             # gloo (CPU) or --backend nccl
    mpirun -n 4 python bench/allreduce_bw.py --backend mpi        # mpi4py, no torch.distributed
    python bench/netsim.py --hosts 4 --rate 1gbit -- python bench/allreduce_bw.py

For every size, one row for `compcomm.compressed_allreduce` ("compressed") and one for the
backend's uncompressed `all_reduce` ("allreduce"), both with op="mean":

    time(us)     per call, averaged over --iters timed calls, then over ranks (min/max shown too)
    algbw(GB/s)  logical bytes / time;   busbw = algbw * 2(n-1)/n
    wire(B)      bytes this rank handed to the transport per call (the backend's bytes_sent)
    peak(x)      peak transient memory of one call (max over ranks) beyond what existed before
                 it, as a multiple of the tensor's fp32 size (bench/peak_memory.py)
    rel_err      ||out - exact|| / ||exact|| for one call on the benchmark's inputs, where exact is
                 the mean of the inputs by an uncompressed fp32 allreduce. For the compressed op it
                 is the first call's (zero error feedback): the error of one 1-bit step. Error
                 feedback carries what a step leaves out into the next ones, so the sum over
                 steps converges; a single step's error stays this large (~0.8 for iid inputs).

Inputs are independent N(0, 1) per rank. Each size uses its own ErrorFeedback per rank.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import socket
import sys
import time

import numpy as np
import torch

from peak_memory import PeakMemory, mmap_threshold_env, supported as memory_measurable

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20,
          "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}
DTYPES = {"float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
          "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
RECORD_KEYS = ("op", "size_bytes", "count", "dtype", "world_size", "backend", "time_us",
               "algbw_GBps", "busbw_GBps", "wire_bytes", "rel_error")


def parse_size(text: str) -> int:
    """'1M' -> 1048576 (binary units, as nccl-tests); plain integers are bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).upper() not in _UNITS:
        raise argparse.ArgumentTypeError(f"bad size {text!r}; use e.g. 4096, 64K, 1M, 256M, 1G")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def human(nbytes: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes:g} B"


def sweep_sizes(lo: int, hi: int, factor: float, elem: int) -> list[int]:
    """Sizes lo, lo*factor, ... <= hi, rounded down to whole elements (at least one)."""
    if lo <= 0 or hi < lo:
        raise ValueError(f"need 0 < --min-bytes <= --max-bytes, got {lo}, {hi}")
    if factor <= 1:
        raise ValueError(f"--factor must be > 1, got {factor}")
    sizes, size = [], float(lo)
    while size <= hi * (1 + 1e-9):
        nbytes = max(elem, int(size) // elem * elem)
        if not sizes or nbytes != sizes[-1]:
            sizes.append(nbytes)
        size *= factor
    return sizes


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("-b", "--min-bytes", type=parse_size, default=parse_size("1M"), help="smallest size (default 1M)")
    p.add_argument("-e", "--max-bytes", type=parse_size, default=parse_size("64M"), help="largest size (default 64M)")
    p.add_argument("-f", "--factor", type=float, default=2.0, help="size multiplier between rows (default 2)")
    p.add_argument("-n", "--iters", type=int, default=5, help="timed calls per size and op (default 5)")
    p.add_argument("-w", "--warmup", type=int, default=2, help="untimed calls before timing (default 2)")
    p.add_argument("-d", "--dtype", default="float32", choices=sorted(DTYPES), help="element type (default float32)")
    p.add_argument("--backend", default="gloo", choices=("gloo", "mpi", "nccl"), help="transport (default gloo)")
    p.add_argument("--nprocs", type=int, default=4,
                   help="ranks to spawn locally when not launched by torchrun/mpirun (default 4)")
    p.add_argument("--ops", default="compressed,allreduce",
                   help="comma-separated ops to run: compressed, allreduce (default both)")
    p.add_argument("--hierarchical", action="store_true",
                   help="also run the compressed op on compcomm.backends.get('hierarchical'): exact within "
                        "each node of LOCAL_WORLD_SIZE ranks, 1-bit across nodes (torchrun/netsim launches)")
    p.add_argument("--json", metavar="PATH", help="write the result records (SPEC 7 keys) as a JSON list")
    p.add_argument("--plot", metavar="PATH", help="write a PNG of busbw vs size, compressed vs allreduce")
    p.add_argument("--title", default=None, help="plot title suffix (e.g. the simulated link)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")
    return p


# ---------------------------------------------------------------------------------------------
# one rank

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _gather_floats(be, value: float) -> np.ndarray:
    """Every rank's `value` (through the backend's own uint8 all_gather; works on any backend)."""
    send = torch.from_numpy(np.array([value], dtype=np.float64).view(np.uint8).copy()).to(be.device)
    recv = torch.empty(be.world_size, 8, dtype=torch.uint8, device=be.device)
    be.all_gather(send, recv)
    return recv.cpu().numpy().copy().view(np.float64).reshape(-1)


def _time_calls(be, fn, iters: int) -> tuple[np.ndarray, float]:
    """(per-call seconds on every rank, wire bytes per call on this rank)."""
    be.barrier()
    _sync(be.device)
    sent = be.bytes_sent
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync(be.device)
    elapsed = (time.perf_counter() - start) / iters
    wire = (be.bytes_sent - sent) / iters
    return _gather_floats(be, elapsed), wire


def _rel_error(out: torch.Tensor, exact: torch.Tensor) -> float:
    diff = out.double() - exact.double()
    norm = float(exact.double().norm())
    return float(diff.norm()) / norm if norm > 0 else float(diff.norm())


def run_rank(args, be, label: str, hier=None) -> list[dict] | None:
    """Run the sweep on one rank; rank 0 prints the table and returns the records.

    With `hier` (a hierarchical backend over the same ranks), the compressed op also runs on it:
    extra rows with backend "hierarchical"."""
    import compcomm

    rank, n, device = be.rank, be.world_size, be.device
    dtype = DTYPES[args.dtype]
    elem = torch.empty((), dtype=dtype).element_size()
    sizes = sweep_sizes(args.min_bytes, args.max_bytes, args.factor, elem)
    ops = [op.strip() for op in args.ops.split(",") if op.strip()]
    for op in ops:
        if op not in ("compressed", "allreduce"):
            raise SystemExit(f"unknown op {op!r} in --ops (choose compressed, allreduce)")
    if args.iters < 1 or args.warmup < 0:
        raise SystemExit("--iters must be >= 1 and --warmup >= 0")
    lanes = [(op, be, args.backend) for op in ops] + ([("compressed", hier, "hierarchical")] if hier else [])
    busfactor = 2 * (n - 1) / n
    records: list[dict] = []
    lead = rank == 0
    if lead:
        print(f"# compcomm allreduce_bw: {label}, world size {n}, backend {args.backend}, dtype {args.dtype}, "
              f"iters {args.iters}, warmup {args.warmup}, op mean")
        print("#" + " " * 64 + "|  time across ranks (us)")
        print(f"# {'size(B)':>11} {'count':>10} {'type':>8} {'op':>10} | {'time(us)':>11} {'algbw(GB/s)':>11} "
              f"{'busbw(GB/s)':>11} {'wire(B)/rank':>13} {'peak(x)':>7} {'rel_err':>9} | {'min':>11} {'max':>11}", flush=True)
    t_start = time.perf_counter()
    for index, size in enumerate(sizes):
        count = size // elem
        gen = torch.Generator().manual_seed(args.seed + 7919 * rank + 104729 * index)
        x = torch.randn(count, generator=gen, dtype=torch.float32).to(dtype=dtype, device=device)
        # The exact mean, from an uncompressed fp32 allreduce of the same inputs (also a warm-up).
        exact = x.float() if x.dtype != torch.float32 else x.clone()
        be.all_reduce(exact, "mean")
        rows = {}
        for op, lane, name in lanes:
            buf = torch.empty_like(x)
            if op == "allreduce":
                def call():
                    be.all_reduce(buf, "mean")
                buf.copy_(x)
                call()
                err = _rel_error(buf, exact)
                for _ in range(args.warmup - 1):
                    call()
            else:
                ef = compcomm.ErrorFeedback()

                def call():
                    compcomm.compressed_allreduce(buf, ef, backend=lane, op="mean")
                buf.copy_(x)
                call()  # a fresh ErrorFeedback: the error of one compressed step
                err = _rel_error(buf, exact)
                for _ in range(args.warmup - 1):
                    buf.copy_(x)
                    call()
            times, wire = _time_calls(lane, call, args.iters)
            with PeakMemory(device) as probe:
                call()
            peak = float(_gather_floats(be, probe.bytes).max()) if memory_measurable(device) else float("nan")
            rows[op, name] = (times, wire, err, peak)
        del x, exact
        for op, _, name in lanes:
            times, wire, err, peak = rows[op, name]
            t = float(times.mean())
            algbw = size / t / 1e9
            rec = {"op": op, "size_bytes": size, "count": count, "dtype": args.dtype, "world_size": n,
                   "backend": name, "time_us": t * 1e6, "algbw_GBps": algbw,
                   "busbw_GBps": algbw * busfactor, "wire_bytes": int(round(wire)), "rel_error": err,
                   "time_min_us": float(times.min()) * 1e6, "time_max_us": float(times.max()) * 1e6,
                   "iters": args.iters, "warmup": args.warmup,
                   "peak_transient_bytes": None if math.isnan(peak) else int(peak)}
            peak_ratio = peak / (4 * count)
            records.append(rec)
            if lead:
                shown = "hier" if name == "hierarchical" else op
                print(f"  {size:>11d} {count:>10d} {args.dtype:>8} {shown:>10} | {rec['time_us']:>11.1f} "
                      f"{algbw:>11.4f} {rec['busbw_GBps']:>11.4f} {rec['wire_bytes']:>13d} {peak_ratio:>7.3f} {err:>9.2e} | "
                      f"{rec['time_min_us']:>11.1f} {rec['time_max_us']:>11.1f}", flush=True)
        if lead and not args.quiet:
            print(f"[allreduce_bw] {index + 1}/{len(sizes)} sizes done ({human(size)}), "
                  f"{time.perf_counter() - t_start:.1f}s elapsed", file=sys.stderr, flush=True)
    if lead:
        _summary(records)
        if args.json:
            write_json(records, args.json)
        if args.plot:
            write_plot(records, args.plot, args.title or label)
        return records
    return None


def _summary(records: list[dict]) -> None:
    by = {(r["op"], r["backend"] == "hierarchical", r["size_bytes"]): r for r in records}
    pairs = [(by[("compressed", False, s)], by[("allreduce", False, s)]) for (op, h, s) in by
             if op == "compressed" and not h and ("allreduce", False, s) in by]
    if pairs:
        print("# speedup (allreduce time / compressed time) and wire-byte ratio per size:")
    for c, a in pairs:
        ratio = a["wire_bytes"] / c["wire_bytes"] if c["wire_bytes"] else float("inf")
        print(f"#   {human(c['size_bytes']):>10}: speedup {a['time_us'] / c['time_us']:6.2f}x, "
              f"wire {ratio:5.1f}x less")
    flat = [(by[key], by[("compressed", False, key[2])]) for key in by if key[1] and ("compressed", False, key[2]) in by]
    if flat:
        print("# hierarchical speedup (flat compressed time / hierarchical time) per size:")
    for h, c in flat:
        print(f"#   {human(h['size_bytes']):>10}: speedup {c['time_us'] / h['time_us']:6.2f}x")


def write_json(records: list[dict], path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(records, f, indent=1)
        f.write("\n")


def write_plot(records: list[dict], path: str, title: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise SystemExit(f"--plot needs matplotlib ({exc}); install it with: pip install matplotlib "
                         "(or compcomm[plot]), or drop --plot") from None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for op, style in (("compressed", "o-"), ("allreduce", "s--")):
        rows = sorted((r for r in records if r["op"] == op), key=lambda r: r["size_bytes"])
        if rows:
            ax.plot([r["size_bytes"] for r in rows], [r["busbw_GBps"] for r in rows], style,
                    label=f"{op} (mean)")
    if records:
        r0 = records[0]
        title = f"{title}: {r0['world_size']} ranks, {r0['backend']}, {r0['dtype']}"
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("size (bytes)")
    ax.set_ylabel("busbw (GB/s) = size/time * 2(n-1)/n")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# launch modes

def _set_threads() -> None:
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads and threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))


def _torch_dist_backend(name: str, local_rank: int):
    import torch.distributed as dist
    from compcomm import backends

    if name == "nccl":
        if not torch.cuda.is_available():
            raise SystemExit("--backend nccl needs CUDA GPUs; use --backend gloo on CPU")
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    if not dist.is_initialized():
        dist.init_process_group(name, timeout=datetime.timedelta(minutes=30))
    return backends.get(name)


def _spawned(rank: int, args, world: int, port: int, result_path: str | None) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world)))
    _set_threads()
    import torch.distributed as dist

    be = _torch_dist_backend(args.backend, rank)
    try:
        run_rank(args, be, f"{world} local ranks (self-spawned)")
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _reexec_for_memory_measurement() -> None:
    """Restart once with large allocations bypassing glibc's heap, which would hide reuse."""
    env = mmap_threshold_env()
    if sys.platform.startswith("linux") and any(os.environ.get(k) != v for k, v in env.items()):
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **env})


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        _reexec_for_memory_measurement()
    args = build_parser().parse_args(argv)
    try:
        sweep_sizes(args.min_bytes, args.max_bytes, args.factor, 1)
    except ValueError as exc:
        build_parser().error(str(exc))
    if args.plot:  # fail before the sweep, not after it
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise SystemExit("--plot needs matplotlib; install it (pip install matplotlib) or drop --plot")

    from compcomm import backends

    if args.hierarchical and (args.backend == "mpi" or "LOCAL_WORLD_SIZE" not in os.environ):
        raise SystemExit("--hierarchical runs under torchrun or bench/netsim.py --ranks-per-host, which set "
                         "LOCAL_WORLD_SIZE (ranks per node), with --backend gloo or nccl")
    if args.backend == "mpi":
        if not backends.launched_by_mpi():
            raise SystemExit("--backend mpi runs under an MPI launcher, e.g.: "
                             f"mpirun -n {args.nprocs} {sys.executable} {' '.join(sys.argv)}")
        _set_threads()
        be = backends.get("mpi")
        run_rank(args, be, "mpirun")
        return 0
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        _set_threads()
        be = _torch_dist_backend(args.backend, int(os.environ.get("LOCAL_RANK", "0")))
        label = "netsim " + os.environ["NETSIM_RATE"] if os.environ.get("NETSIM_RATE") else "torchrun"
        if os.environ.get("NETSIM_DELAY"):
            label += f" +{os.environ['NETSIM_DELAY']}"
        hier = backends.get("hierarchical") if args.hierarchical else None
        try:
            run_rank(args, be, label, hier)
        finally:
            import torch.distributed as dist
            dist.destroy_process_group()
        return 0
    if args.nprocs < 1:
        raise SystemExit("--nprocs must be >= 1")
    import torch.multiprocessing as mp

    mp.spawn(_spawned, args=(args, args.nprocs, _free_port(), None), nprocs=args.nprocs, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

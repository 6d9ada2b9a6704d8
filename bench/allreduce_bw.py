#!/usr/bin/env python3
"""Bandwidth sweep of the compressed allreduce against the plain one, nccl-tests style.

    python bench/allreduce_bw.py                                  # spawns 4 local gloo ranks
    torchrun --nproc-per-node 4 bench/allreduce_bw.py             # gloo (CPU) or --backend nccl
    mpirun -n 4 --oversubscribe python bench/allreduce_bw.py --backend mpi   # mpi4py (as root: --allow-run-as-root)
    python bench/netsim.py --hosts 4 --rate 1gbit -- python bench/allreduce_bw.py

For every size, one row for `compcomm.compressed_allreduce` ("compressed") and one for the
backend's uncompressed `all_reduce` ("allreduce"), both with op="mean" (and with `--ops` a row
"exact": compressed_allreduce below its `min_compress_bytes`, compcomm's exact path):

    time(us)     per call, averaged over --iters timed calls (min/max over those calls shown too);
                 a call's time is the slowest rank's
    algbw(GB/s)  logical bytes / time;   busbw = algbw * 2(n-1)/n
    wirebw(GB/s) wire(B) / time
    wire(B)      bytes this rank handed to the transport per call (the backend's bytes_sent; on
                 the hierarchical rows the bytes inside the node too, which no link between hosts
                 carries: shared memory or loopback)
    peak(x)      peak transient memory of one call (max over ranks) beyond what existed before
                 it, as a multiple of the tensor's fp32 size (bench/peak_memory.py)
    rel_err      ||out - exact|| / ||exact|| for one call on the benchmark's inputs, where exact is
                 the mean of the inputs by an uncompressed fp32 allreduce. For the compressed op it
                 is the first call's (zero error feedback): the error of one 1-bit step. Error
                 feedback carries what a step leaves out into the next ones, so the sum over
                 steps converges; a single step's error stays this large (~0.9 for iid inputs).

Inputs are independent N(0, 1) per rank. Each size uses its own ErrorFeedback per rank.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import sys
import time

import numpy as np
import torch

import emulation
from codec_passes import time_passes
from collective_model import flat_bytes, flat_parts
from peak_memory import PeakMemory, mmap_threshold_env
from peak_memory import supported as memory_measurable
from ranks import add_nprocs_argument, gather_floats, launch_label, launched_world, mpirun_needed, set_threads
from records import codec_line, make_parent, output_path, rel_error, write_json
from units import human, parse_rate, parse_size

OPS = ("compressed", "allreduce", "exact")
DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


MAX_ROWS = 100
"""The most sizes a sweep takes (--factor 2 from 1 byte to 1 TiB is 41), so that a factor just
above 1 is refused rather than spending minutes listing millions of sizes before any rank starts."""


def sweep_sizes(lo: int, hi: int, factor: float, elem: int) -> list[int]:
    """Sizes lo, lo*factor, ... <= hi, rounded down to whole elements (at least one, which
    --max-bytes must hold: a row is never larger than it)."""
    if lo <= 0 or hi < lo:
        raise ValueError(f"need 0 < --min-bytes <= --max-bytes, got {lo}, {hi}")
    if hi < elem:
        raise ValueError(f"--max-bytes {hi} is less than one element ({elem} bytes): no size to time")
    if not (math.isfinite(factor) and factor > 1):
        raise ValueError(f"--factor must be a finite number > 1, got {factor}")
    rows = math.floor(math.log(hi / lo) / math.log(factor)) + 1 if hi > lo else 1
    if rows > MAX_ROWS:
        raise ValueError(
            f"--factor {factor!r} from {lo} to {hi} bytes makes about {rows} sizes, more than {MAX_ROWS}: "
            "take a larger --factor or a narrower range"
        )
    sizes, size = [], float(lo)
    while size <= hi * (1 + 1e-9):
        nbytes = max(elem, int(size) // elem * elem)
        if not sizes or nbytes != sizes[-1]:
            sizes.append(nbytes)
        size *= factor
    return sizes


def memory_problem(max_bytes: int, elem: int, ranks_here: int, physical: int) -> str | None:
    """Why the largest size cannot fit in this host's memory, or None: each rank holds at least
    the input and the copy it reduces in the tensor's dtype, and the exact mean and the two
    worker-error buffers in fp32, so that a size no host could hold is a usage error before any
    rank starts, not an allocator's failure on every rank after the smaller sizes ran."""
    need = ranks_here * max_bytes * (2 + 3 * 4 / elem)
    if need <= physical:
        return None
    return (
        f"--max-bytes {human(max_bytes)} needs at least {human(need)} of memory on this host ({ranks_here} "
        f"rank(s), each holding the input, its copy, the exact mean and two error buffers), more than its "
        f"{human(physical)}: take a smaller --max-bytes"
    )


def rate_argument(text: str) -> str:
    """argparse type of --link-rate: the rate as written (it labels the outlook's row), once
    `parse_rate` reads it, so that a bad one is refused before the sweep, not after it."""
    parse_rate(text)
    return text


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    p.add_argument("-b", "--min-bytes", type=parse_size, default=parse_size("1M"), help="smallest size (default 1M)")
    p.add_argument("-e", "--max-bytes", type=parse_size, default=parse_size("64M"), help="largest size (default 64M)")
    p.add_argument("-f", "--factor", type=float, default=2.0, help="size multiplier between rows (default 2)")
    p.add_argument("-n", "--iters", type=int, default=5, help="timed calls per size and op (default 5)")
    p.add_argument(
        "-w",
        "--warmup",
        type=int,
        default=2,
        help="untimed calls before timing (default 2; at least 1 runs: the first call measures the error)",
    )
    p.add_argument("-d", "--dtype", default="float32", choices=sorted(DTYPES), help="element type (default float32)")
    p.add_argument("--backend", default="gloo", choices=("gloo", "mpi", "nccl"), help="transport (default gloo)")
    add_nprocs_argument(p)
    p.add_argument(
        "--ops",
        default="compressed,allreduce",
        help="comma-separated ops to run: compressed, allreduce, exact (compcomm's "
        "uncompressed path, as below min_compress_bytes) (default compressed,allreduce)",
    )
    p.add_argument(
        "--hierarchical",
        action="store_true",
        help="also run the compressed op on compcomm.backends.get('hierarchical'): exact within "
        "each node of LOCAL_WORLD_SIZE ranks, 1-bit across nodes (torchrun/netsim launches)",
    )
    p.add_argument(
        "--intra",
        choices=("shm", "gloo", "nccl"),
        default=None,
        help="with --hierarchical: the transport inside a node (default: shm under gloo, nccl under nccl)",
    )
    p.add_argument(
        "--json",
        metavar="PATH",
        type=output_path,
        help="write the result records as a JSON list (keys: docs/guides/measuring.md)",
    )
    p.add_argument(
        "--plot", metavar="PATH", type=output_path, help="write a PNG of busbw vs size, compressed vs allreduce"
    )
    p.add_argument("--title", default=None, help="plot title suffix (e.g. the simulated link)")
    p.add_argument(
        "--link-rate",
        type=rate_argument,
        default=None,
        help="per-host link rate drawn on the plot, tc syntax (e.g. 1gbit; default: bench/netsim.py's)",
    )
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")
    return p


# ---------------------------------------------------------------------------------------------
# one rank


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_calls(be, fn, iters: int) -> tuple[np.ndarray, float]:
    """(seconds of each call, as the slowest rank saw it; wire bytes per call on this rank).

    Ranks start together (a barrier), then run the calls back to back; call i's time is the
    largest over ranks of its own duration."""
    be.barrier()
    _sync(be.device)
    sent = be.bytes_sent
    durations = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        _sync(be.device)
        durations.append(time.perf_counter() - start)
    wire = (be.bytes_sent - sent) / iters
    return gather_floats(be, durations).max(axis=0), wire


def check_args(args) -> list[str]:
    """The ops to run, after rejecting bad --ops / --iters / --warmup / --intra /
    --backend (in `main`, before any rank is spawned, and again on each rank); sets
    `args.dtype` to the type's one name (bf16 -> bfloat16), as the records carry it."""
    ops = [op.strip() for op in args.ops.split(",") if op.strip()]
    for op in ops:
        if op not in OPS:
            raise SystemExit(f"unknown op {op!r} in --ops (choose from {', '.join(OPS)})")
    if not ops:
        raise SystemExit(f"--ops names no op (choose from {', '.join(OPS)})")
    if args.iters < 1 or args.warmup < 0:
        raise SystemExit("--iters must be >= 1 and --warmup >= 0")
    if args.intra is not None and not args.hierarchical:
        raise SystemExit("--intra is the transport inside a node of --hierarchical: add --hierarchical or drop it")
    if args.backend == "nccl" and not torch.cuda.is_available():
        raise SystemExit("--backend nccl needs CUDA GPUs; use --backend gloo on CPU")
    if args.intra == "nccl" and not torch.cuda.is_available():
        raise SystemExit("--intra nccl needs CUDA GPUs; use --intra shm or gloo on CPU")
    args.dtype = str(DTYPES[args.dtype]).removeprefix("torch.")  # one name per type in the records
    return ops


def print_header(args, n: int, label: str) -> None:
    print(
        f"# compcomm allreduce_bw: {label}, world size {n}, backend {args.backend}, dtype {args.dtype}, "
        f"iters {args.iters}, warmup {max(1, args.warmup)}, op mean"
    )
    print(codec_line())
    if emulation.label():
        print(f"# times: {emulation.label()} (bench/netsim.py --cpus-per-host, time dilation)")
    if not memory_measurable(torch.device("cpu")):
        env = " ".join(f"{name}={value}" for name, value in mmap_threshold_env().items())
        print(f"# peak(x): not measured on CPU here (start the ranks with {env} to measure it)")
    print("#" + " " * 78 + "|  time across iterations (us)")
    print(
        f"# {'size(B)':>11} {'count':>10} {'type':>8} {'op':>10} | {'time(us)':>11} {'algbw(GB/s)':>11} "
        f"{'busbw(GB/s)':>11} {'wirebw(GB/s)':>12} {'wire(B)/rank':>13} {'peak(x)':>7} {'rel_err':>9} | "
        f"{'min':>11} {'max':>11}",
        flush=True,
    )


def print_row(rec: dict) -> None:
    peak = rec["peak_transient_bytes"]
    ratio = f"{peak / (4 * rec['count']):>7.3f}" if peak is not None else f"{'n/a':>7}"
    shown = "hier" if rec["backend"] == "hierarchical" else rec["op"]
    print(
        f"  {rec['size_bytes']:>11d} {rec['count']:>10d} {rec['dtype']:>8} {shown:>10} | "
        f"{rec['time_us']:>11.1f} {rec['algbw_GBps']:>11.4f} {rec['busbw_GBps']:>11.4f} "
        f"{rec['wire_busbw_GBps']:>12.4f} {rec['wire_bytes']:>13d} {ratio} {rec['rel_error']:>9.2e} | "
        f"{rec['time_min_us']:>11.1f} {rec['time_max_us']:>11.1f}",
        flush=True,
    )


def operation(op: str, be, x: torch.Tensor, exact: torch.Tensor, warmup: int):
    """(call, rel_error) for one op on a fresh copy of x: `call()` runs it once more in place;
    the error is that of the first call (for the compressed op, with zero error feedback)."""
    import compcomm

    buf = x.clone()
    if op == "allreduce":

        def call() -> None:
            be.all_reduce(buf, "mean")
    else:
        ef = compcomm.ErrorFeedback()
        # "exact": the same call below min_compress_bytes, i.e. compcomm's uncompressed path
        threshold = buf.numel() * buf.element_size() + 1 if op == "exact" else None

        def call() -> None:
            compcomm.compressed_allreduce(buf, ef, backend=be, op="mean", min_compress_bytes=threshold)

    call()
    err = rel_error(buf, exact)
    for _ in range(warmup - 1):
        buf.copy_(x)
        call()
    return call, err


def measure(op: str, be, x: torch.Tensor, exact: torch.Tensor, args, size: int, name: str | None = None) -> dict:
    """The record of one op at one size: times, bandwidths, wire bytes, error, peak memory
    (`name`: the backend column, default --backend)."""
    n = be.world_size
    call, err = operation(op, be, x, exact, args.warmup)
    times, wire = _time_calls(be, call, args.iters)
    times = times / emulation.dilation()
    with PeakMemory(be.device) as probe:
        call()
    peak = float(gather_floats(be, probe.bytes).max()) if memory_measurable(be.device) else math.nan
    t = float(times.mean())
    algbw = size / t / 1e9
    return {
        "op": op,
        "size_bytes": size,
        "count": x.numel(),
        "dtype": args.dtype,
        "world_size": n,
        "backend": name or args.backend,
        "time_us": t * 1e6,
        "algbw_GBps": algbw,
        "busbw_GBps": algbw * 2 * (n - 1) / n,
        "wire_bytes": int(round(wire)),
        "rel_error": err,
        "wire_busbw_GBps": wire / t / 1e9,
        "time_min_us": float(times.min()) * 1e6,
        "time_max_us": float(times.max()) * 1e6,
        "iters": args.iters,
        "warmup": max(1, args.warmup),  # the first call, which measures the error, always runs (-w 0 too)
        "peak_transient_bytes": None if math.isnan(peak) else int(peak),
        **emulation.record_fields(),
    }


def run_rank(args, be, label: str, hier=None) -> list[dict] | None:
    """Run the sweep on one rank; rank 0 prints the table and writes the outputs. With `hier`
    (a hierarchical backend over the same ranks), the compressed op also runs on it: extra rows
    with backend "hierarchical"."""
    rank, device, dtype = be.rank, be.device, DTYPES[args.dtype]
    ops = check_args(args)
    elem = torch.empty((), dtype=dtype).element_size()
    sizes = sweep_sizes(args.min_bytes, args.max_bytes, args.factor, elem)
    lead = rank == 0
    if lead:
        print_header(args, be.world_size, label)
        if hier is not None:
            print(f"# hier rows: {hier.intra.name} inside a node, {hier.inter.name} across nodes", flush=True)
    records: list[dict] = []
    t_start = time.perf_counter()
    for index, size in enumerate(sizes):
        gen = torch.Generator().manual_seed(args.seed + 7919 * rank + 104729 * index)
        x = torch.randn(size // elem, generator=gen, dtype=torch.float32).to(dtype=dtype, device=device)
        # The exact mean, from an uncompressed fp32 allreduce of the same inputs (also a warm-up).
        exact = x.float() if x.dtype != torch.float32 else x.clone()
        be.all_reduce(exact, "mean")
        rows = [measure(op, be, x, exact, args, size) for op in ops]
        if hier is not None:
            rows.append(measure("compressed", hier, x, exact, args, size, "hierarchical"))
        records += rows
        if lead:
            for rec in rows:
                print_row(rec)
            if not args.quiet:
                print(
                    f"[allreduce_bw] {index + 1}/{len(sizes)} sizes done ({human(size)}), "
                    f"{time.perf_counter() - t_start:.1f}s elapsed",
                    file=sys.stderr,
                    flush=True,
                )
    if not lead:
        return None
    _summary(records)
    if args.backend != "nccl":
        print_outlook(be.world_size, max(sizes) // elem, args)
    if args.json:
        write_json(records, args.json)
    if args.plot:
        write_plot(records, args.plot, args.title or label, link_rate(args))
    return records


def _summary(records: list[dict]) -> None:
    """nccl-tests' closing averages, one per op (the hierarchical rows apart, as "hier"), then the
    ratios of the flat compressed op against the allreduce and the hierarchical one against it."""
    groups = {op: [r for r in records if r["op"] == op and r["backend"] != "hierarchical"] for op in OPS}
    groups["hier"] = [r for r in records if r["backend"] == "hierarchical"]
    for shown, rows in groups.items():
        if rows:  # as nccl-tests ends its table
            print(f"# Avg bus bandwidth    : {sum(r['busbw_GBps'] for r in rows) / len(rows):.4f} ({shown})")
    by = {(r["op"], r["size_bytes"]): r for r in records if r["backend"] != "hierarchical"}
    pairs = [
        (by[("compressed", s)], by[("allreduce", s)]) for (op, s) in by if op == "compressed" and ("allreduce", s) in by
    ]
    if pairs:
        print("# speedup (allreduce time / compressed time) and wire-byte ratio per size:")
    for c, a in pairs:
        # on one rank neither op sends anything
        wire = f"wire {a['wire_bytes'] / c['wire_bytes']:5.1f}x less" if c["wire_bytes"] else "no wire bytes"
        exact = by.get(("exact", c["size_bytes"]))
        versus = f", exact path {a['time_us'] / exact['time_us']:6.2f}x" if exact else ""
        print(f"#   {human(c['size_bytes']):>10}: speedup {a['time_us'] / c['time_us']:6.2f}x, {wire}{versus}")
    flat = [
        (h, by[("compressed", h["size_bytes"])])
        for h in records
        if h["backend"] == "hierarchical" and ("compressed", h["size_bytes"]) in by
    ]
    if flat:
        print("# hierarchical speedup (flat compressed time / hierarchical time) per size:")
    for h, c in flat:
        print(f"#   {human(h['size_bytes']):>10}: speedup {c['time_us'] / h['time_us']:6.2f}x")


OUTLOOK_RATES = ("1gbit", "10gbit", "25gbit", "100gbit")
OUTLOOK_ALPHA = 50e-6
"""Seconds per step of a collective over TCP between hosts (gloo, MPI): the latency the outlook assumes."""
OUTLOOK_EFFICIENCY = 0.9
"""The share of a link's rate a bulk TCP transfer achieves."""


def print_outlook(n: int, numel: int, args) -> None:
    """What 1-bit buys on a real network: the codec passes timed on this machine, turned by the
    cost model (bench/collective_model.py, docs/cost_model.md) into predicted call times next to
    an fp32 ring allreduce for the link rates that matter; then how to measure it for real."""
    given = args.link_rate or os.environ.get("NETSIM_RATE") or None
    rates = list(OUTLOOK_RATES) + ([given] if given and given not in OUTLOOK_RATES else [])
    passes = time_passes(numel, n)
    moved = flat_bytes(numel, n)
    gamma = {name: moved[name] / seconds for name, seconds in passes.items()}
    where = (
        f"a simulated cluster ({os.environ.get('NETSIM_RATE')} links)"
        if os.environ.get("NETSIM_RATE")
        else "one machine over loopback: loopback is not a network, so the table above measures "
        "this machine's memory and cores, not a link"
    )
    print("#")
    print("# What 1-bit buys on your network")
    print(f"#   these ranks ran on {where}.")
    print(
        f"#   codec passes of a {human(4 * numel)} call over {n} ranks, timed here on one core (GB/s): "
        + ", ".join(f"{name} {g / 1e9:.1f}" for name, g in gamma.items())
    )
    print(
        f"#   predicted by the cost model for {human(4 * numel)} fp32 over {n} hosts, one rank each "
        f"({OUTLOOK_ALPHA * 1e6:.0f} us per collective step, {OUTLOOK_EFFICIENCY:.0%} of the link):"
    )
    print(f"#     {'link':>10} {'fp32 allreduce':>15} {'1-bit':>10} {'speedup':>8}")
    for rate in rates:
        link = parse_rate(rate) / 8 * OUTLOOK_EFFICIENCY
        model = {"alpha": OUTLOOK_ALPHA, "burst": 0.0, "B": link, "gamma": gamma}
        t = flat_parts(model, numel, n, 1.0, row_by_row=args.backend == "gloo")  # gloo overlaps phases and codec
        mark = "  (this run's link)" if rate == given else ""
        print(
            f"#     {rate:>10} {t['allreduce'] * 1e3:>12.1f} ms {t['call'] * 1e3:>7.1f} ms "
            f"{t['allreduce'] / t['call']:>7.1f}x{mark}"
        )
    print(
        "#   rel_err is one call's error with no error feedback carried yet (~0.9 for random inputs): error "
        "feedback carries it into the next calls, so sums over steps converge (bench/convergence.py)."
    )
    print("#   measure it on an emulated cluster with a core per host (root, Linux):")
    print(f"#     python bench/netsim.py --hosts {n} --rate 10gbit --cpus-per-host 1 -- python bench/allreduce_bw.py")
    print("#   or on your own nodes (one rank per node, run on every node):")
    print(
        f"#     torchrun --nnodes {n} --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint HOST0:29500 "
        "bench/allreduce_bw.py"
    )


def link_rate(args) -> float | None:
    """The per-host link rate in GB/s to draw on the plot: --link-rate, else the simulated
    network's (NETSIM_RATE, set by bench/netsim.py), else None."""
    text = args.link_rate or os.environ.get("NETSIM_RATE")
    return parse_rate(text) / 8e9 if text else None


def write_plot(records: list[dict], path: str, title: str, rate_GBps: float | None = None) -> None:
    """busbw against size (MiB) for both ops; with a link rate, the line an uncompressed
    allreduce cannot pass and the 1-bit ideal (the link carrying only sign bits)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise SystemExit(
            f"--plot needs matplotlib ({exc}); install it with: pip install matplotlib "
            "(or compcomm[plot]), or drop --plot"
        ) from None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for op, style in (("compressed", "o-"), ("allreduce", "s--"), ("exact", "^:")):
        rows = sorted((r for r in records if r["op"] == op), key=lambda r: r["size_bytes"])
        if rows:
            ax.plot(
                [r["size_bytes"] / 2**20 for r in rows], [r["busbw_GBps"] for r in rows], style, label=f"{op} (mean)"
            )
    if records:
        r0 = records[0]
        title = f"{title}: {r0['world_size']} ranks, {r0['backend']}, {r0['dtype']}"
        if rate_GBps is not None:
            bits_per_element = 8 * r0["size_bytes"] // r0["count"]
            ax.axhline(rate_GBps, color="grey", linestyle=":", label=f"link rate ({rate_GBps:g} GB/s)")
            ax.axhline(
                rate_GBps * bits_per_element,
                color="grey",
                linestyle="-.",
                label=f"1-bit ideal ({bits_per_element}x link rate)",
            )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("size (MiB)")
    ax.set_ylabel("busbw (GB/s) = size/time * 2(n-1)/n")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(make_parent(path), dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# launch modes (compcomm.launch: torchrun / netsim environment, mpirun, or self-spawned ranks)


def _torch_dist_rank(args, label: str) -> None:
    """One rank started with torchrun's environment: join the group, run, leave."""
    from compcomm import backends, launch

    set_threads()
    if args.backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    with launch.process_group(args.backend, timeout=datetime.timedelta(minutes=30)):
        hier = backends.get("hierarchical", intra=args.intra) if args.hierarchical else None
        run_rank(args, backends.get(args.backend), label, hier)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        sweep_sizes(args.min_bytes, args.max_bytes, args.factor, DTYPES[args.dtype].itemsize)
    except ValueError as exc:
        build_parser().error(str(exc))
    check_args(args)
    if args.backend != "nccl":  # the tensors live in this host's memory
        ranks_here = args.nprocs if launched_world() is None else int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        problem = memory_problem(args.max_bytes, DTYPES[args.dtype].itemsize, ranks_here, physical)
        if problem:
            raise SystemExit(problem)
    if args.plot:  # fail before the sweep, not after it
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise SystemExit("--plot needs matplotlib; install it (pip install matplotlib) or drop --plot") from None
    from compcomm import backends, launch

    how = launch.launcher()
    if args.hierarchical and (args.backend == "mpi" or how != "torchrun"):
        raise SystemExit(
            "--hierarchical runs under torchrun or bench/netsim.py --ranks-per-host, which set "
            "LOCAL_WORLD_SIZE (ranks per node), with --backend gloo or nccl"
        )
    if args.backend == "mpi":
        why = mpirun_needed(args.nprocs)
        if why:
            raise SystemExit(why)
        set_threads()
        run_rank(args, backends.get("mpi"), launch_label(args.nprocs))
    elif launched_world() is not None:  # torchrun, bench/netsim.py, or mpirun's ranks as one gloo group
        _torch_dist_rank(args, launch_label(args.nprocs))
    else:
        # Ranks start with large allocations bypassing glibc's heap (which would hide reuse from
        # the peak-memory column) and an even share of the cores.
        os.environ.update(mmap_threshold_env())
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.nprocs)))
        launch.spawn(_torch_dist_rank, args.nprocs, args, launch_label(args.nprocs))
    return 0


if __name__ == "__main__":
    sys.exit(main())

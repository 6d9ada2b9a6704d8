#!/usr/bin/env python3
"""A per-phase timeline of the flat and the hierarchical 1-bit call, as they run in one cluster.

    python bench/netsim.py --hosts 2 --ranks-per-host 2 --rate 1gbit --cpus-per-host 1 -- \\
        python bench/timeline.py --size 100M --json t.json --png t.png

Where bench/phases.py times each part of a call alone, this times the whole call and records when
each of its steps ran on every rank, so that what overlaps and what waits shows: the flat call
over all ranks and (with several ranks per host, LOCAL_WORLD_SIZE > 1) the hierarchical one,
alternated, --calls of each after a warm-up. Every rank records, per call,

    spans       [step, start, end] of each step of the schedule it ran, nested steps included:
                call, phase 0, node exchange (shm: the blocks written and waited for; the
                scan and what it starts run inside), scan (a chunk of the worker pass), phase 1,
                server (the server pass), error update, phase 2, decode (a chunk of the output),
                share (the node's all-gather of results and the other parts' decode)
    cpu         the CPU time the process used during the call (all its threads, user + system)

and under bench/netsim.py the first rank of each host samples its host's outgoing link (the
namespace's eth0 transmit counter, about every half millisecond), so the wire shows beside the
steps. Times are emulated (divided by the dilation d; CPU times are not: a host's quota of C / d
real cores stands for its C emulated ones); a call's origin is the earliest rank's start after a
barrier, on the one clock the ranks share (they must run on one machine, as netsim's do). The
report gives each kind's calls, the CPU each host used against the cores it had (busy: CPU time
over call time x cores per host), and for the call of median time, per rank, each step's busy
time and an ASCII chart; --png draws that call (matplotlib).

The steps are timed by wrapping the schedule's functions for this process only (their results
and bits are untouched); the wrappers and the sampler cost a few microseconds per step.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from emulation import dilation, record_fields
from ranks import add_nprocs_argument, launch_label, launched_world, run_ranks, set_threads
from records import codec_line, make_parent, output_path, write_json
from units import parse_rate, parse_size

STEPS = (
    "call",
    "phase 0",
    "node exchange",
    "scan",
    "phase 1",
    "server",
    "error update",
    "phase 2",
    "decode",
    "share",
)
LINK_COUNTER = "/sys/class/net/eth0/statistics/tx_bytes"  # inside a bench/netsim.py namespace
BOOT_ID = "/proc/sys/kernel/random/boot_id"  # one per running kernel: ranks that share it share CLOCK_MONOTONIC
SAMPLE_S = 0.0005
CHART_COLUMNS = 100
LINK_BINS = 250  # of the drawn chart's link lanes


class Recorder:
    """Spans of the schedule's steps in this process: (step, start, end), monotonic seconds
    (CLOCK_MONOTONIC, the same clock in every process of the machine)."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, float, float]] = []

    def wrap(self, owner: Any, name: str, step: str) -> None:
        """Replace owner.name (a module function or a class's method) by a timed call of it."""
        original = getattr(owner, name)

        @functools.wraps(original)
        def timed(*args, **kwargs):
            start = time.monotonic()
            try:
                return original(*args, **kwargs)
            finally:
                self.spans.append((step, start, time.monotonic()))

        setattr(owner, name, timed)

    def instrument(self) -> None:
        """Wrap every step of the flat and hierarchical schedules (see the module's docstring)."""
        import compcomm
        from compcomm import codec
        from compcomm.backends.base import Backend
        from compcomm.backends.hierarchical import HierarchicalBackend
        from compcomm.backends.shm import ShmBackend
        from compcomm.schedules import flat, hierarchical

        for name in ("agree_on_call", "agree_on_arguments", "agree_on_measures"):
            self.wrap(flat, name, "phase 0")
        self.wrap(hierarchical, "_agree_over_all_ranks", "phase 0")
        self.wrap(flat.WorkerScan, "chunk", "scan")
        self.wrap(flat, "exchange_rows", "phase 1")
        self.wrap(Backend, "all_to_all_as_produced", "phase 1")
        self.wrap(codec.Codec, "server_scan_", "server")
        self.wrap(codec.Codec, "error_update_", "error update")
        self.wrap(Backend, "all_gather_arriving", "phase 2")
        self.wrap(flat, "decode_chunk", "decode")
        self.wrap(ShmBackend, "exchange_blocks", "node exchange")
        self.wrap(HierarchicalBackend, "exchange_in_node", "node exchange")
        self.wrap(hierarchical, "_share_result", "share")
        self.wrap(compcomm, "compressed_allreduce", "call")


class LinkSampler:
    """(time, bytes sent) of this host's link, sampled in a thread while `running` is set (and
    by the caller at the edges of a call: `mark`), and that thread's CPU time, which the calls'
    CPU figures leave out."""

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_RDONLY)
        self.samples: list[tuple[float, int]] = []
        self.running = threading.Event()
        self.done = False
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()
        assert self.thread.ident is not None
        self.clock = time.pthread_getcpuclockid(self.thread.ident)

    def _loop(self) -> None:
        while not self.done:
            if self.running.wait(0.05):
                self.mark()
                time.sleep(SAMPLE_S)

    def mark(self) -> None:
        """One sample, now."""
        self.samples.append((time.monotonic(), int(os.pread(self.fd, 32, 0))))

    def cpu_s(self) -> float:
        """The sampling thread's CPU time so far."""
        return time.clock_gettime(self.clock)

    def take(self) -> list[tuple[float, int]]:
        """The samples since the last take, in time order."""
        samples, self.samples = self.samples, []
        return sorted(samples)

    def close(self) -> None:
        self.done = True
        self.thread.join()
        os.close(self.fd)


def run_calls(args: argparse.Namespace) -> dict:
    """Every rank: the alternated calls with their spans; the report's data (all ranks')."""
    import compcomm
    from compcomm import backends

    set_threads(args.nprocs)
    numel, calls, warmup = parse_size(args.size) // 4, args.calls, args.warmup
    rank, world = dist.get_rank(), dist.get_world_size()
    per_host = args.ranks_per_host or int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    kinds = {"flat": backends.get("gloo")}
    if 1 < per_host < world:
        kinds["hierarchical"] = backends.get("hierarchical", local_world_size=per_host)
    machines: list[Any] = [None] * world
    with open(BOOT_ID) as f:
        dist.all_gather_object(machines, f.read().strip())
    if len(set(machines)) > 1:
        raise SystemExit(
            "timeline.py compares the ranks' CLOCK_MONOTONIC, which only one machine shares: "
            "run it on local ranks or inside bench/netsim.py"
        )
    recorder = Recorder()
    recorder.instrument()
    sampler = LinkSampler(LINK_COUNTER) if rank % per_host == 0 and os.environ.get("NETSIM_RATE") else None
    x = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
    buf = torch.empty_like(x)
    errors = {kind: compcomm.ErrorFeedback() for kind in kinds}
    mine: list[dict] = []
    try:
        for i in range(warmup + calls):
            for kind, be in kinds.items():
                buf.copy_(x)
                dist.barrier()
                recorder.spans.clear()
                sampler_cpu = 0.0
                if sampler is not None:
                    sampler.take()
                    sampler.mark()
                    sampler.running.set()
                    sampler_cpu = sampler.cpu_s()
                cpu = time.process_time()
                compcomm.compressed_allreduce(buf, errors[kind], backend=be)
                cpu = time.process_time() - cpu
                if sampler is not None:
                    cpu -= sampler.cpu_s() - sampler_cpu
                dist.barrier()  # every rank's call is over: nothing more leaves for it
                if sampler is not None:
                    time.sleep(0.002)  # the call's last bytes leave the shaper's queue
                    sampler.running.clear()
                    sampler.mark()
                if i >= warmup:
                    link = sampler.take() if sampler is not None else None
                    spans = list(recorder.spans)
                    mine.append({"kind": kind, "call": i - warmup, "spans": spans, "cpu_s": cpu, "link": link})
    finally:
        if sampler is not None:
            sampler.close()
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    return {"numel": numel, "world": world, "per_host": per_host, "records": everyone}


def assemble(data: dict) -> list[dict]:
    """One record per call: every rank's spans and CPU, its hosts' link samples, times emulated
    and from the call's origin, in ms."""
    d, per_host = dilation(), data["per_host"]
    calls: dict[tuple[str, int], dict] = {}
    for rank, records in enumerate(data["records"]):
        for rec in records:
            call = calls.setdefault((rec["kind"], rec["call"]), {"kind": rec["kind"], "call": rec["call"], "ranks": []})
            call["ranks"].append({"rank": rank, "host": rank // per_host, **rec})
    out = []
    for call in calls.values():
        origin = min(start for r in call["ranks"] for step, start, _ in r["spans"] if step == "call")
        end = max(stop for r in call["ranks"] for step, _, stop in r["spans"] if step == "call")

        def ms(t: float) -> float:
            return round((t - origin) / d * 1e3, 4)

        ranks, links = [], []
        for r in sorted(call["ranks"], key=lambda r: r["rank"]):
            spans = sorted(([step, ms(a), ms(b)] for step, a, b in r["spans"]), key=lambda s: (s[1], -s[2]))
            # CPU time is not dilated: a host's quota of C / d real cores is its C emulated cores
            ranks.append({"rank": r["rank"], "host": r["host"], "cpu_ms": r["cpu_s"] * 1e3, "spans": spans})
            if r["link"]:
                base = r["link"][0][1]
                links.append({"host": r["host"], "samples": [[ms(t), n - base] for t, n in r["link"]]})
        time_ms = (end - origin) / d * 1e3
        out.append({"kind": call["kind"], "call": call["call"], "time_ms": time_ms, "ranks": ranks, "links": links})
    return out


def busy(spans: list[list], step: str) -> tuple[float, float, float]:
    """(ms covered by the step's spans, first start, last end); nested spans of one step count once."""
    intervals = sorted((a, b) for s, a, b in spans if s == step)
    if not intervals:
        return 0.0, float("nan"), float("nan")
    total, (lo, hi) = 0.0, intervals[0]
    for a, b in intervals[1:]:
        if a > hi:
            total, lo = total + hi - lo, a
        hi = max(hi, b)
    return total + hi - lo, intervals[0][0], max(b for _, b in intervals)


def link_bytes(samples: list[list], lo: float, hi: float) -> float:
    """Bytes the link sent in [lo, hi) ms, interpolated between samples."""

    def at(t: float) -> float:
        before = [s for s in samples if s[0] <= t]
        after = [s for s in samples if s[0] > t]
        if not before:
            return 0.0
        if not after:
            return before[-1][1]
        (t0, n0), (t1, n1) = before[-1], after[0]
        return n0 + (n1 - n0) * (t - t0) / (t1 - t0)

    return at(hi) - at(lo)


def blind_spots(samples: list[list], longer_than_ms: float = 2.0) -> list[tuple[float, float]]:
    """The stretches between two samples more than `longer_than_ms` apart in which the link sent
    bytes (the sampler did not run: its host's quota was spent, or it waited for the GIL): when in
    them the bytes left is unknown, and the chart marks them '?'."""
    return [(a[0], b[0]) for a, b in zip(samples, samples[1:]) if b[0] - a[0] > longer_than_ms and b[1] > a[1]]


def link_cells(link: dict, span_ms: float, columns: int, rate_Bps: float | None) -> list[str]:
    """A host's link over [0, span_ms) in `columns` cells: '#' at least half busy, '+' at least a
    tenth, '.' idle, '?' not sampled while it sent (the busiest cell is full without a rate)."""
    width = span_ms / columns
    blind = blind_spots(link["samples"])
    sent = [link_bytes(link["samples"], c * width, (c + 1) * width) for c in range(columns)]
    full = rate_Bps * width / 1e3 if rate_Bps else max(sent, default=0.0) or 1.0
    cells = []
    for c, n in enumerate(sent):
        unknown = any(a < (c + 1) * width and b > c * width for a, b in blind)
        cells.append("?" if unknown else "#" if n >= 0.5 * full else "+" if n >= 0.1 * full else ".")
    return cells


def chart(call: dict, rate_Bps: float | None, columns: int = CHART_COLUMNS) -> list[str]:
    """ASCII chart of one call: a row per rank and step ('#' where it ran), and each host's link
    (`link_cells`)."""
    span = call["time_ms"]
    width = span / columns
    lines = [f"{'':24}|{'0':<{columns // 2}}{span / 2:.1f} ms{'':>{columns - columns // 2 - 7}}|{span:.1f} ms"]
    for r in call["ranks"]:
        for step in STEPS:
            cells = [" "] * columns
            for s, a, b in r["spans"]:
                if s == step:
                    for c in range(int(a / width), min(columns, int(b / width) + 1)):
                        cells[c] = "#"
            if "#" in cells:
                lines.append(f"rank {r['rank']} {step:<17}|{''.join(cells)}|")
    for link in call["links"]:
        lines.append(f"host {link['host']} link out       |{''.join(link_cells(link, span, columns, rate_Bps))}|")
    return lines


def describe(meta: dict) -> str:
    """The run in words, for the report's and the chart's titles."""
    cores = f", {meta['cpus_per_host']:g} core(s) per host" if meta["cpus_per_host"] else ""
    emulated = f", emulated (time / d), d = {meta['dilation']:g}" if meta["emulated"] else ""
    return (
        f"{meta['size_bytes']} bytes fp32, {meta['world_size']} ranks, {meta['ranks_per_host']} per host, "
        f"{meta['launch']}{cores}{emulated}"
    )


def by_time(calls: list[dict], kind: str) -> tuple[list[dict], dict]:
    """A kind's calls, fastest first, and its median call, the one reported and charted: the middle
    one (the lower of the two middle ones for an even count, so that it is a call that ran, and
    the median printed is its time)."""
    mine = sorted((c for c in calls if c["kind"] == kind), key=lambda c: c["time_ms"])
    return mine, mine[(len(mine) - 1) // 2]


def lower(mine: list[dict]) -> str:
    """What the median call is, where the count of calls leaves a choice."""
    return "" if len(mine) % 2 else ", the lower of the two middle calls"


def link_rate(meta: dict) -> float | None:
    """The emulated link's rate in bytes per second (None outside netsim)."""
    return parse_rate(meta["rate"]) / 8 if meta["rate"] else None


def report(calls: list[dict], meta: dict) -> list[str]:
    """The printed report (see the module's docstring)."""
    rate = link_rate(meta)
    cores = meta["cpus_per_host"] or (os.cpu_count() or 1) / max(1, meta["hosts"])
    lines = [f"timeline: {describe(meta)}"]
    for kind in dict.fromkeys(c["kind"] for c in calls):
        mine, median = by_time(calls, kind)
        times = ", ".join(f"{c['time_ms']:.1f}" for c in sorted(mine, key=lambda c: c["call"]))
        lines += ["", f"== {kind}: calls {times} ms; median {median['time_ms']:.1f} ms{lower(mine)}"]
        hosts = sorted({r["host"] for r in median["ranks"]})
        for h in hosts:
            cpu = [sum(r["cpu_ms"] for r in c["ranks"] if r["host"] == h) for c in mine]
            load = [x / (c["time_ms"] * cores) for x, c in zip(cpu, mine)]
            lines.append(
                f"host {h}: CPU {statistics.median(cpu):.1f} ms per call (median), "
                f"busy {statistics.median(load):.0%} of {cores:g} core(s)"
            )
        lines.append(
            f"median call (call {median['call']}, {median['time_ms']:.1f} ms), ms: step, busy, first start - last end"
        )
        for r in median["ranks"]:
            cells = []
            for step in STEPS:
                total, first, last = busy(r["spans"], step)
                if total:
                    cells.append(f"{step} {total:.1f} ({first:.1f}-{last:.1f})")
            lines.append(f"  rank {r['rank']}: " + "; ".join(cells))
        for link in median["links"]:
            sent = link["samples"][-1][1] if link["samples"] else 0
            wire = f", {sent / rate * 1e3:.1f} ms of wire at {meta['rate']}" if rate else ""
            blind = sum(b - a for a, b in blind_spots(link["samples"]))
            lines.append(f"  host {link['host']} link: {sent} bytes out{wire}; {blind:.1f} ms unsampled while sending")
        lines += chart(median, rate)
    return lines


def draw(calls: list[dict], path: str, meta: dict) -> None:
    """The median call of each kind as bars per rank and step, and each host's link (dark: at
    least half busy, light: at least a tenth, pink: not sampled while it sent)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rate = link_rate(meta)
    kinds = list(dict.fromkeys(c["kind"] for c in calls))
    fig, axes = plt.subplots(len(kinds), 1, figsize=(12, 3 + 2.2 * len(kinds)), squeeze=False)
    colors = {step: plt.get_cmap("tab10")(i) for i, step in enumerate(STEPS)}
    for ax, kind in zip(axes[:, 0], kinds):
        mine, call = by_time(calls, kind)
        rows, y = [], 0
        for r in call["ranks"]:
            for step in STEPS:
                bars = [(a, b - a) for s, a, b in r["spans"] if s == step]
                if bars:
                    ax.broken_barh(bars, (y, 0.8), color=colors[step])
                    rows.append(f"rank {r['rank']} {step}")
                    y += 1
        for link in call["links"]:
            cells = link_cells(link, call["time_ms"], LINK_BINS, rate)
            width = call["time_ms"] / LINK_BINS
            for mark, color in (("#", "dimgrey"), ("+", "silver"), ("?", "pink")):
                bars = [(c * width, width) for c, cell in enumerate(cells) if cell == mark]
                ax.broken_barh(bars, (y, 0.8), color=color)
            rows.append(f"host {link['host']} link out")
            y += 1
        ax.set_yticks([i + 0.4 for i in range(len(rows))], rows, fontsize=7)
        ax.set_title(f"{kind}: call {call['call']}, {call['time_ms']:.1f} ms (median call{lower(mine)})", fontsize=9)
        ax.set_xlabel("ms" + (" (emulated)" if meta["emulated"] else ""))
        ax.invert_yaxis()
    fig.suptitle(describe(meta), fontsize=10)
    fig.tight_layout()
    fig.savefig(make_parent(path), dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="100M", help="fp32 tensor size in bytes (default 100M)")
    p.add_argument("--calls", type=int, default=5, help="timed calls of each kind (default 5)")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls of each kind first (default 2)")
    p.add_argument(
        "--ranks-per-host",
        type=int,
        default=None,
        help="ranks per node of the hierarchical call (default: LOCAL_WORLD_SIZE when launched, 2 when self-spawned)",
    )
    add_nprocs_argument(p)
    p.add_argument("--json", metavar="PATH", type=output_path, help="write the calls' records as JSON")
    p.add_argument("--png", metavar="PATH", type=output_path, help="draw the median calls (needs matplotlib)")
    args = p.parse_args(argv)
    if args.calls < 1 or args.warmup < 0:
        raise SystemExit("--calls must be at least 1 and --warmup at least 0")
    launched = launched_world() is not None
    world = int(os.environ["WORLD_SIZE"]) if launched else args.nprocs
    if args.ranks_per_host is None and not launched:
        if world % 2:
            raise SystemExit(
                f"{world} self-spawned ranks do not split into hosts of 2, the default --ranks-per-host: give an "
                "even --nprocs (flat and hierarchical calls), or --ranks-per-host 1 (the flat call alone)"
            )
        args.ranks_per_host = 2
    if args.ranks_per_host is not None and (args.ranks_per_host < 1 or world % args.ranks_per_host):
        raise SystemExit(f"--ranks-per-host {args.ranks_per_host} must divide the {world} ranks")
    how = launch_label(world)
    data, world = run_ranks(run_calls, args, world)
    if data is None:
        return 0
    meta = {
        "size_bytes": data["numel"] * 4,
        "world_size": world,
        "ranks_per_host": data["per_host"],
        "hosts": world // data["per_host"],
        "rate": os.environ.get("NETSIM_RATE", ""),
        "launch": how,
        "calls": args.calls,
        "warmup": args.warmup,
        **record_fields(),
    }
    calls = assemble(data)
    print("\n".join([codec_line(), *report(calls, meta)]), flush=True)
    if args.json:
        write_json({"meta": meta, "calls": calls}, args.json)
    if args.png:
        draw(calls, args.png, meta)
    return 0


if __name__ == "__main__":
    sys.exit(main())

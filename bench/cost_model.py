#!/usr/bin/env python3
"""Cost model of the flat and hierarchical 1-bit allreduce: calibrate, check, extrapolate.

    python bench/cost_model.py --calibrate bench/results/phases_2h_1gbit.json \\
        bench/results/phases_4h_1gbit.json bench/results/phases_8h_1gbit.json ...

Each phase costs latency + bytes / bandwidth, or codec bytes / memory bandwidth:

    comm part over a group of g ranks:  alpha * (g - 1) * share  +  max(0, bytes - burst) / B
    codec pass:                         bytes moved / gamma_pass * share
    share = max(1, ranks on the machine / cores): ranks of a simulated cluster share its cores,
            or, in an emulated cluster (netsim --cpus-per-host C), max(1, ranks per host / C)

and the call overlaps what the schedule overlaps (`collective_model.flat_parts`: on gloo, phase 1
during the scan and phase 2 during the decode where rows are wide; the worker error in the x'
form, which the scan writes: no werr pass).
The calibration file (one run of bench/phases.py, ideally 2 hosts, so share = 1) gives alpha
(header), B (a2a and gather bytes) and every gamma (its codec passes); `--loopback FILE` (a run with
several ranks per host) gives a collective inside the host its own latency alpha_lo (share, at its
smallest size) and bandwidth B_lo (rs); every other file is then predicted and printed next to its
measurements. With `--latency FILE` (a run on more hosts) a collective's latency is alpha0 + alpha
(g - 1), fitted on the two runs' phase-0 headers (medians over their sizes), and the calibration
run's smallest call gives a per-call overhead (what the call costs beyond its parts, times share).
`--extrapolate` prints the model at 64-1024 ranks for a data-centre network (parameters in
EXTRAPOLATION, stated in docs/cost_model.md).
"""

from __future__ import annotations

import argparse
import json
import statistics

from collective_model import BURST, CODEC, chunk, flat_bytes, flat_parts, hier_parts, node_sum


def core_share(record: dict, cores: int) -> float:
    """How many of a run's rank threads share one core: those of the whole machine when the
    simulated hosts share its cores freely, those of one host when each host had its own quota
    (an emulated run's times are already the emulated cluster's)."""
    threads = record.get("ranks_per_host", 1) * record.get("threads", 1)
    if record.get("cpus_per_host"):
        return max(1.0, threads / record["cpus_per_host"])
    return max(1.0, record["world_size"] * record.get("threads", 1) / cores)


def calibrate(record: dict, cores: int, loopback: list[dict] | None = None) -> dict:
    """alpha, B and the gammas from one flat run (1 rank per host); from the records of a run
    with several ranks per host, the latency of a collective inside the host alpha_lo (its
    smallest `share`, a few KiB) and the host's bandwidth B_lo (its largest `rs`: the node's
    exchange of fp32 blocks, and with more than two ranks per host the pass summing all but the
    last block, which `node_sum` charges apart)."""
    n, numel = record["world_size"], record["numel"]
    share = core_share(record, cores)
    b = flat_bytes(numel, n)
    p = {
        "burst": BURST,
        "alpha": record["header_s"] / ((n - 1) * share),
        "gamma": {part: b[part] * share / record[part + "_s"] for part in CODEC},
    }
    sent = b["a2a"] + b["gather"] + b["allreduce"] - 3 * BURST
    p["B"] = sent / (record["a2a_s"] + record["gather_s"] + record["allreduce_s"] - 4 * p["alpha"] * (n - 1) * share)
    if loopback:
        small, large = min(loopback, key=lambda r: r["numel"]), max(loopback, key=lambda r: r["numel"])
        k, lo_share = large["ranks_per_host"], core_share(large, cores)
        p["alpha_lo"] = small["share_s"] / ((k - 1) * core_share(small, cores))
        moved = (k - 1) * 4.0 * chunk(large["numel"], k)
        exchange = large["rs_s"] - node_sum(p, large["numel"], k, lo_share) - p["alpha_lo"] * (k - 1) * lo_share
        p["B_lo"] = moved / max(1e-9, exchange)
    return p


def fit_latency(p: dict, calibration: list[dict], latency: list[dict], cores: int) -> None:
    """alpha0 + alpha (n - 1) through the median phase-0 header of two runs of different sizes
    (per unit of CPU share), then the per-call overhead: what the calibration run's smallest call
    took beyond the model's sum of its parts."""

    def per_share(records: list[dict]) -> tuple[int, float]:
        n = records[0]["world_size"]
        return n, statistics.median(r["header_s"] / core_share(r, cores) for r in records)

    (n_a, h_a), (n_b, h_b) = per_share(calibration), per_share(latency)
    if n_a == n_b:
        raise ValueError(f"--latency needs a run on another number of ranks than the calibration's ({n_a})")
    p["alpha"] = max(0.0, (h_b - h_a) / (n_b - n_a))
    p["alpha0"] = max(0.0, h_a - p["alpha"] * (n_a - 1))
    small = min(calibration, key=lambda r: r["numel"])
    share = core_share(small, cores)
    model = flat_parts(p, small["numel"], small["world_size"], share, small.get("ranks_per_host", 1))["call"]
    p["overhead"] = max(0.0, (small["call_s"] - model) / share)


EXTRAPOLATION = {
    # A data-centre cluster of GPUs: per-rank NIC at the line rate below (80% achieved), 8 GPUs per
    # node on NVLink, fused GPU codec passes at 1 TB/s of effective memory bandwidth, 10 us per
    # message of a collective step (NCCL over RoCE/IB is a few us, TCP/gloo tens of us).
    "alpha": 10e-6,
    "burst": 0.0,
    "efficiency": 0.8,
    "gamma_codec": 1e12,
    "nvlink": 150e9,
    "k": 8,
}


def extrapolate(numel: int) -> list[str]:
    x = EXTRAPOLATION
    rows = [
        "| ranks | link | fp32 ring allreduce | flat 1-bit | of which latency | hierarchical (8/node) "
        "| flat speedup | hier speedup |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for gbit in (25, 100):
        bandwidth = gbit / 8 * 1e9 * x["efficiency"]
        p = {
            "alpha": x["alpha"],
            "burst": 0.0,
            "B": bandwidth * x["k"],
            "alpha_lo": x["alpha"],
            "B_lo": x["nvlink"],
            "gamma": {part: x["gamma_codec"] for part in CODEC},
        }
        for n in (64, 128, 256, 512, 1024):
            flat = flat_parts(p, numel, n, 1.0, x["k"], row_by_row=False)  # NCCL: one collective per phase
            latency = x["alpha"] * (n - 1) * 3
            hier = hier_parts(p, numel, n // x["k"], x["k"], 1.0, row_by_row=False)["hier"]
            rows.append(
                f"| {n} | {gbit} Gbit/s | {flat['allreduce'] * 1e3:.1f} ms | {flat['call'] * 1e3:.1f} ms | "
                f"{latency * 1e3:.1f} ms | {hier * 1e3:.1f} ms | {flat['allreduce'] / flat['call']:.1f}x | "
                f"{flat['allreduce'] / hier:.1f}x |"
            )
    return rows


def size_label(size: int) -> str:
    """`size` bytes in MiB, or KiB below one MiB (a 64 KiB run read "0 MiB")."""
    return f"{size / 2**20:g} MiB" if size >= 2**20 else f"{size / 2**10:g} KiB"


def compare(record: dict, p: dict, cores: int) -> list[str]:
    n, numel, k = record["world_size"], record["numel"], record.get("ranks_per_host", 1)
    share = core_share(record, cores)
    pred = flat_parts(p, numel, n, share, k)
    if k > 1 and "B_lo" in p:
        pred.update(hier_parts(p, numel, n // k, k, share))
    rows = []
    for part in ("header", *CODEC, "a2a", "gather", "call", "allreduce", "rs", "share", "hier"):
        if part + "_s" in record and part in pred:
            got, want = record[part + "_s"], pred[part]
            rows.append(
                f"| {n // k}x{k} | {size_label(record['size_bytes'])} | {part} | {got * 1e3:.2f} | "
                f"{want * 1e3:.2f} | {(want - got) / got:+.0%} |"
            )
    return rows


PHASES_KEYS = ("world_size", "numel", "size_bytes", "header_s", "call_s")
"""What every record of a bench/phases.py run holds (an allreduce_bw.py run's records do not)."""


def read_phases(path: str, need: tuple[str, ...] = ()) -> list[dict]:
    """The records of the bench/phases.py JSON at `path`, each holding PHASES_KEYS and `need`;
    else a ValueError that names the file and says what it should be."""
    try:
        with open(path) as f:
            records = json.load(f)
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} is not JSON ({exc}); expected the records of bench/phases.py --json") from None
    keys = (*PHASES_KEYS, *need)
    if not isinstance(records, list) or not records or not all(isinstance(r, dict) for r in records):
        raise ValueError(f"{path} is not a list of records; expected the records of bench/phases.py --json")
    missing = sorted({key for r in records for key in keys if key not in r})
    if missing:
        raise ValueError(
            f"{path} is not a bench/phases.py run with what is needed here: its records lack {', '.join(missing)}"
            + (" (it holds bench/allreduce_bw.py records)" if "time_us" in records[0] else "")
        )
    return records


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calibrate", required=True, help="phases JSON whose largest size calibrates the model")
    ap.add_argument("files", nargs="*", help="phases JSON files to predict")
    ap.add_argument(
        "--loopback",
        help="phases JSON, several ranks per host: alpha_lo from its smallest share row, B_lo from its largest rs row",
    )
    ap.add_argument(
        "--latency", help="phases JSON on more ranks: fits latency alpha0 + alpha (n-1) and a per-call overhead"
    )
    ap.add_argument(
        "--cores", type=int, default=2, help="cores of the machine the runs shared, where not emulated (default 2)"
    )
    ap.add_argument("--extrapolate", action="store_true", help="print the 64-1024 rank table (100 MiB fp32)")
    args = ap.parse_args(argv)
    if args.cores < 1:
        ap.error(f"--cores must be at least 1, got {args.cores}")
    try:  # every file is read before any is used: a wrong one is refused before anything prints
        calibration = read_phases(
            args.calibrate, need=tuple(f"{part}_s" for part in ("a2a", "gather", "allreduce", *CODEC))
        )
        loopback = read_phases(args.loopback, need=("ranks_per_host", "rs_s", "share_s")) if args.loopback else None
        latency_run = read_phases(args.latency) if args.latency else None
        predicted = [calibration, *(read_phases(path) for path in args.files)]
    except ValueError as exc:
        ap.error(str(exc))
    base = max(calibration, key=lambda r: r["numel"])
    if base["world_size"] < 2:
        ap.error(
            f"--calibrate needs a run on at least 2 ranks (its latency is per peer step): {args.calibrate} ran on 1"
        )
    p = calibrate(base, args.cores, loopback)
    latency = ""
    if latency_run is not None:
        fit_latency(p, calibration, latency_run, args.cores)
        latency = f" + {p['alpha0'] * 1e6:.0f} us per collective, overhead {p['overhead'] * 1e6:.0f} us per call"
    print(
        f"# calibrated on {args.calibrate} ({base['world_size']} ranks, {base['size_bytes']} bytes): "
        f"alpha {p['alpha'] * 1e6:.0f} us/step{latency}, B {p['B'] / 1e6:.1f} MB/s"
        + (f", alpha_lo {p['alpha_lo'] * 1e6:.0f} us/step, B_lo {p['B_lo'] / 1e6:.0f} MB/s" if "B_lo" in p else "")
        + ", gamma (GB/s) "
        + ", ".join(f"{k} {v / 1e9:.1f}" for k, v in p["gamma"].items())
    )
    print("| hosts x ranks | size | part | measured (ms) | model (ms) | model error |")
    print("|---|---|---|---|---|---|")
    for records in predicted:
        for record in records:
            print("\n".join(compare(record, p, args.cores)))
    if args.extrapolate:
        print("\n".join(extrapolate(100 * 2**20 // 4)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

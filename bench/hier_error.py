#!/usr/bin/env python3
"""Accuracy of hierarchical against flat 1-bit compression over many calls with error feedback.

    python bench/netsim.py --hosts 2 --ranks-per-host 2 -- python bench/hier_error.py --size 100M --calls 30

Run under torchrun or bench/netsim.py (LOCAL_WORLD_SIZE ranks per node). For each of --calls
calls every rank draws a fresh N(0, 1) input; the exact mean comes from an uncompressed fp32
all_reduce; the flat collective (over all ranks) and the hierarchical one each reduce a copy,
each with its own ErrorFeedback carried across the calls. Printed per method: the mean over
calls of ||out - exact|| / ||exact||, and the same ratio for the sums over all calls (which error
feedback drives towards zero). `--json` writes both.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from ranks import set_threads
from records import output_path, rel_error, write_json
from units import parse_size


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=parse_size, default=parse_size("1M"), help="fp32 bytes per call (default 1M)")
    p.add_argument("--calls", type=int, default=30, help="calls with error feedback (default 30)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--json", metavar="PATH", type=output_path, help="write the result as JSON")
    args = p.parse_args(argv)
    if "LOCAL_WORLD_SIZE" not in os.environ:
        raise SystemExit("run under torchrun or bench/netsim.py --ranks-per-host K")
    import compcomm
    from compcomm import backends, launch

    set_threads()
    numel = args.size // 4
    with launch.process_group("gloo"):
        flat, hier = backends.get("gloo"), backends.get("hierarchical")
        rank, world = flat.rank, flat.world_size
        methods = {
            "flat": (flat, compcomm.ErrorFeedback("flat")),
            "hierarchical": (hier, compcomm.ErrorFeedback("hier")),
        }
        errors: dict[str, list[float]] = {name: [] for name in methods}
        sums = {name: torch.zeros(numel, dtype=torch.float64) for name in [*methods, "exact"]}
        for call in range(args.calls):
            x = torch.randn(numel, generator=torch.Generator().manual_seed(args.seed + 7919 * rank + 104729 * call))
            exact = flat.all_reduce(x.clone(), "mean")
            sums["exact"] += exact
            for name, (be, ef) in methods.items():
                out = compcomm.compressed_allreduce(x.clone(), ef, backend=be)
                errors[name].append(rel_error(out, exact))
                sums[name] += out
    if rank:
        return 0
    result = {
        "world_size": world,
        "ranks_per_node": int(os.environ["LOCAL_WORLD_SIZE"]),
        "size_bytes": 4 * numel,
        "calls": args.calls,
    }
    for name in methods:
        result[f"{name}_mean_rel_error"] = sum(errors[name]) / len(errors[name])
        result[f"{name}_rel_error_of_sum"] = rel_error(sums[name], sums["exact"])
    result["ratio_hierarchical_to_flat"] = result["hierarchical_mean_rel_error"] / result["flat_mean_rel_error"]
    print(
        f"# {result['world_size']} ranks, {result['ranks_per_node']} per node, {args.calls} calls of "
        f"{4 * numel} bytes with error feedback"
    )
    for name in methods:
        print(
            f"{name:>13}: mean relative error per call {result[f'{name}_mean_rel_error']:.4f}, "
            f"of the sum over calls {result[f'{name}_rel_error_of_sum']:.4f}"
        )
    print(f"hierarchical / flat mean relative error: {result['ratio_hierarchical_to_flat']:.3f}")
    if args.json:
        write_json([result], args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())

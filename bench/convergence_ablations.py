"""Ablations of 1-bit LAMB's compression stage: which part of it costs loss against LAMB.

Runs bench/convergence.py's `onebit_lamb` (same task, data, model and settings; every
convergence.py option applies) with one piece of the compression stage changed per variant:

    shipped                OnebitLamb as it is
    exact-momentum         the momentum averaged exactly (fp32 all-reduce) instead of in 1 bit;
                           the update rule kept (v frozen, frozen coefficient times the factor)
    live-coefficient       exact momentum and LAMB's own trust ratio clamp(||w|| / ||u||) at
                           every step, u from the frozen v: LAMB with v frozen at the freeze
    live-coefficient-1bit  the same trust ratio on the 1-bit momentum (what the paper avoids)
    factor-one             1-bit as shipped, the variance factor pinned to 1
                           (factor_min = factor_max = 1)

exact-momentum isolates the 1-bit compression, live-coefficient the frozen coefficient,
live-coefficient-1bit why the paper freezes it, factor-one the variance factor. It prints each
variant's final validation loss and its gap to the `lamb` baseline given by --baseline (from
convergence_transformer.json), and writes --json.

    python bench/convergence_ablations.py --task transformer --hidden 64 --context 32 --batch 16 \\
        --lr-adam 6e-3 --lr-lamb 2e-2 --json bench/results/convergence_transformer_ablations.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from typing import Any

import convergence
import torch

from compcomm import optim
from compcomm.optim import base, lamb
from compcomm.optim.updates import mask_, master_weight, store_

VARIANTS = ("shipped", "exact-momentum", "live-coefficient", "live-coefficient-1bit", "factor-one")


def exact_average(tensor: torch.Tensor, errors: Any, backend: Any, op: str, async_op: bool) -> Any:
    """In place of the 1-bit collective: the exact average over the same backend (errors unused)."""
    return backend.all_reduce(tensor, op, async_op=async_op)


class LiveCoefficientLamb(optim.OnebitLamb):
    """The compression stage with LAMB's own trust ratio on the frozen-variance update."""

    def _compressed_update(
        self, t: int, p: torch.Tensor, m: torch.Tensor, group: dict[str, Any], state: dict[str, Any]
    ) -> None:
        denom, masked = self._frozen_denominator(p, group)
        state["exp_avg"].copy_(mask_(m, group, denom, masked))
        u = state["exp_avg"].div(1 - group["betas"][0] ** t).div_(denom)
        w = master_weight(p, state)
        if group["weight_decay"]:
            u.add_(w, alpha=group["weight_decay"])
        c, _ = lamb.warmup_coefficient(lamb.trust_ratio(w, u), None, group)
        w.add_(u, alpha=-group["lr"] * c)
        store_(p, w)


class FactorOneLamb(optim.OnebitLamb):
    """OnebitLamb with its variance factor pinned to 1."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **{**kwargs, "factor_min": 1.0, "factor_max": 1.0})


def apply_variant(variant: str) -> None:
    """Change, in this rank's process, what convergence.py's onebit_lamb run builds."""
    if variant in ("exact-momentum", "live-coefficient"):
        base.compressed_allreduce = exact_average  # type: ignore[assignment]
    classes: dict[str, Callable[..., Any]] = {
        "live-coefficient": LiveCoefficientLamb,
        "live-coefficient-1bit": LiveCoefficientLamb,
        "factor-one": FactorOneLamb,
    }
    if variant in classes:
        optim.OnebitLamb = classes[variant]  # type: ignore[misc]


def rank_variants(args: Any) -> list[dict[str, Any]]:
    """Every variant on this rank, each in a fresh process state (the patches do not stack)."""
    out = []
    shipped_collective, shipped_class = base.compressed_allreduce, optim.OnebitLamb
    for variant in args.variants.split(","):
        apply_variant(variant)
        try:
            (res,) = convergence.rank_main(args)
        finally:
            base.compressed_allreduce, optim.OnebitLamb = shipped_collective, shipped_class  # type: ignore[misc]
        out.append({"variant": variant, **res})
    return out


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog="every other option is bench/convergence.py's"
    )
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of " + ",".join(VARIANTS))
    ap.add_argument("--json", help="write the results here")
    ap.add_argument(
        "--baseline",
        default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "convergence_transformer.json"),
        help="a convergence.py JSON whose `lamb` run is the baseline",
    )
    own, rest = ap.parse_known_args(argv)
    unknown = set(own.variants.split(",")) - set(VARIANTS)
    if unknown:
        ap.error(f"unknown variants {sorted(unknown)}")
    args = convergence.parse_args(rest + ["--runs", "onebit_lamb"])
    args.variants = own.variants
    results, world = convergence.run_ranks(rank_variants, args, args.world_size)
    if results is None:
        return
    with open(own.baseline) as f:
        baseline = next(r["final_val_loss"] for r in json.load(f)["runs"] if r["name"] == "lamb")
    for r in results:
        r["gap_vs_lamb_pct"] = 100.0 * (r["final_val_loss"] - baseline) / baseline
        print(
            f"{r['variant']:18s} final val loss {r['final_val_loss']:.4f}  vs lamb {baseline:.4f}: "
            f"{r['gap_vs_lamb_pct']:+.2f}%"
        )
    if own.json:
        report = {
            "world_size": world,
            "lamb_baseline": baseline,
            "args": {k: v for k, v in vars(args).items() if k != "out"},
            "variants": results,
        }
        with open(own.json, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {own.json}")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(sys.argv[1:])

"""Convergence of 1-bit Adam / 1-bit LAMB against their uncompressed selves, on a real task.

A small character-level language model (embedding of a fixed context window -> MLP -> next
character) learns Python's own standard-library sources (read from the local installation,
nothing downloaded). Data-parallel over local gloo ranks that this program spawns itself
(or under torchrun), each rank drawing its own minibatches. Four runs with identical data:

    adam          OnebitAdam with freeze_step = steps  (never compresses: fp32 allreduce Adam)
    onebit_adam   OnebitAdam with freeze_step = warm-up fraction * steps
    lamb          OnebitLamb with freeze_step = steps
    onebit_lamb   OnebitLamb with freeze_step = warm-up fraction * steps

It prints the final validation losses, the gaps, and the bytes each rank handed to the
transport (backend.bytes_sent), and writes `convergence.json` and `convergence.png`
(matplotlib, optional) to --out.

    python bench/convergence.py                      # the recorded run (4 ranks, a few minutes)
    python bench/convergence.py --steps 3000 --hidden 512 --context 32    # a bigger one
    torchrun --nproc-per-node 4 bench/convergence.py
"""
from __future__ import annotations

import argparse
import datetime
import glob
import json
import math
import os
import platform
import time
from typing import Any

import torch
import torch.distributed as dist

from compcomm import launch

RUNS = {  # name: (optimizer, compressed)
    "adam": ("adam", False), "onebit_adam": ("adam", True),
    "lamb": ("lamb", False), "onebit_lamb": ("lamb", True),
}
VOCAB = 128  # ids: ASCII codes compacted to the characters seen often (see load_text)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world-size", type=int, default=4, help="local ranks to spawn (ignored under torchrun)")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--warmup", type=float, default=0.15, help="fraction of steps before compression")
    ap.add_argument("--batch", type=int, default=32, help="sequences per rank per step")
    ap.add_argument("--context", type=int, default=16, help="characters of context")
    ap.add_argument("--embed", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--lr-adam", type=float, default=3e-3)
    ap.add_argument("--lr-lamb", type=float, default=1e-2)
    ap.add_argument("--schedule", choices=["cosine", "constant"], default="cosine",
                    help="learning rate: cosine decay to 10%% over the run, or constant")
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--text-bytes", type=int, default=1_000_000, help="characters of stdlib source to use")
    ap.add_argument("--val-windows", type=int, default=4096)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--runs", default=",".join(RUNS), help="comma-separated subset of " + ",".join(RUNS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = ap.parse_args(argv)
    unknown = set(args.runs.split(",")) - set(RUNS)
    if unknown:
        ap.error(f"unknown runs {sorted(unknown)}")
    return args


# ------------------------------------------------------------------ data and model

def load_text(limit: int) -> torch.Tensor:
    """The standard library's .py sources (sorted, deterministic), as ASCII codes."""
    root = os.path.dirname(os.__file__)
    chunks, total = [], 0
    for path in sorted(glob.glob(os.path.join(root, "*.py"))):
        with open(path, "rb") as f:
            data = f.read()
        chunks.append(data)
        total += len(data)
        if total >= limit:
            break
    raw = b"".join(chunks)[:limit]
    codes = torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()
    # Characters rarer than 1 in 10^4 (and non-ASCII bytes) share id 0. This matters for the
    # compression stage: an embedding row whose gradient is (almost) always zero has a frozen
    # second moment of ~0, and a 1-bit momentum (never exactly zero) divided by sqrt(v) + eps
    # would blow it up -- the reason DeepSpeed's 1-bit Adam has an `exp_avg_mask`.
    counts = torch.bincount(codes, minlength=256)
    keep = (counts >= max(1, len(codes) // 10_000)).nonzero().flatten()
    keep = keep[keep < 128]
    table = torch.zeros(256, dtype=torch.long)
    table[keep] = torch.arange(1, len(keep) + 1)
    return table[codes]


def windows(text: torch.Tensor, starts: torch.Tensor, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    idx = starts[:, None] + torch.arange(context + 1)
    seq = text[idx]
    return seq[:, :-1], seq[:, -1]


class CharMLP(torch.nn.Module):
    """Embed each of `context` characters, concatenate, two hidden layers, next-character logits."""

    def __init__(self, context: int, embed: int, hidden: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, embed)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(context * embed, hidden), torch.nn.GELU(),
            torch.nn.Linear(hidden, hidden), torch.nn.GELU(),
            torch.nn.Linear(hidden, VOCAB))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(self.embed(x).flatten(1))


# ------------------------------------------------------------------ one rank

def run_one(name: str, args: argparse.Namespace, text: torch.Tensor, split: int,
            val: tuple[torch.Tensor, torch.Tensor], rank: int) -> dict[str, Any]:
    import compcomm
    from compcomm.optim import OnebitAdam, OnebitLamb

    kind, compressed = RUNS[name]
    torch.manual_seed(args.seed)  # the same initial model on every rank and in every run
    model = CharMLP(args.context, args.embed, args.hidden)
    backend = compcomm.backends.get("gloo")
    freeze = max(1, round(args.warmup * args.steps)) if compressed else args.steps
    if kind == "adam":
        opt = OnebitAdam(model.parameters(), lr=args.lr_adam, weight_decay=args.weight_decay,
                         freeze_step=freeze, backend=backend)
    else:
        opt = OnebitLamb(model.parameters(), lr=args.lr_lamb, weight_decay=args.weight_decay,
                         freeze_step=freeze, backend=backend)
    if args.schedule == "cosine":
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: 0.1 + 0.45 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps)))
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + rank)  # same batches in every run
    curve, t0 = [], time.perf_counter()
    for step in range(1, args.steps + 1):
        starts = torch.randint(0, split - args.context - 1, (args.batch,), generator=gen)
        x, y = windows(text, starts, args.context)
        model.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        if args.schedule == "cosine":
            sched.step()
        if step % args.eval_every == 0 or step == args.steps:
            curve.append({"step": step, "train_loss": loss.item(), "val_loss": evaluate(model, val)})
    return {"name": name, "optimizer": type(opt).__name__, "freeze_step": freeze,
            "lr": opt.defaults["lr"], "final_val_loss": curve[-1]["val_loss"],
            "bytes_sent": backend.bytes_sent, "seconds": time.perf_counter() - t0, "curve": curve,
            "params": sum(p.numel() for p in model.parameters()), "buckets": len(opt._layout())}


@torch.no_grad()
def evaluate(model: torch.nn.Module, val: tuple[torch.Tensor, torch.Tensor]) -> float:
    x, y = val
    return torch.nn.functional.cross_entropy(model(x), y).item()


def rank_main(args: argparse.Namespace) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    rank = dist.get_rank()
    text = load_text(args.text_bytes)
    split = int(len(text) * 0.9)
    vgen = torch.Generator().manual_seed(12345)
    val_starts = split + torch.randint(0, len(text) - split - args.context - 1, (args.val_windows,), generator=vgen)
    val = windows(text, val_starts, args.context)
    results = []
    for name in args.runs.split(","):
        res = run_one(name, args, text, split, val, rank)
        if rank == 0:
            print(f"  {name:12s} final val loss {res['final_val_loss']:.4f}  bytes/rank {res['bytes_sent']:>12,d}"
                  f"  {res['seconds']:.1f}s", flush=True)
        results.append(res)
    return results


def _spawned(args: argparse.Namespace) -> list[dict[str, Any]] | None:
    """One self-spawned rank (compcomm.launch set torchrun's environment): rank 0's results."""
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    try:
        results = rank_main(args)
        return results if dist.get_rank() == 0 else None
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------ report

def summarize(results: list[dict[str, Any]], args: argparse.Namespace, world: int) -> dict[str, Any]:
    by = {r["name"]: r for r in results}
    summary: dict[str, Any] = {}
    for base, onebit in (("adam", "onebit_adam"), ("lamb", "onebit_lamb")):
        if base in by and onebit in by:
            b, o = by[base]["final_val_loss"], by[onebit]["final_val_loss"]
            summary[f"{onebit}_vs_{base}_gap_pct"] = 100.0 * (o - b) / b
    if "adam" in by:
        for r in results:
            r["bytes_reduction_vs_fp32_adam"] = by["adam"]["bytes_sent"] / r["bytes_sent"]
    warm = args.warmup
    summary["expected_reduction_at_warmup"] = 1.0 / (warm + (1 - warm) / 32)
    return {"task": "char-level LM (MLP) on Python stdlib sources", "world_size": world, "backend": "gloo",
            "args": vars(args), "host": platform.node(), "torch": torch.__version__,
            "summary": summary, "runs": results}


def write_outputs(report: dict[str, Any], out: str) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "convergence.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {os.path.join(out, 'convergence.json')}")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed (pip install compcomm[plot]): no plot")
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, kind in zip(axes, ("adam", "lamb")):
        for r in report["runs"]:
            if RUNS[r["name"]][0] != kind:
                continue
            steps = [c["step"] for c in r["curve"]]
            label = f"{r['name']} (val {r['final_val_loss']:.3f}, {r['bytes_sent'] / 2**20:.1f} MiB/rank)"
            ax.plot(steps, [c["val_loss"] for c in r["curve"]], label=label,
                    linestyle="--" if r["name"].startswith("onebit") else "-")
            if r["name"].startswith("onebit"):
                ax.axvline(r["freeze_step"], color="grey", linewidth=0.8, linestyle=":")
        ax.set_title(f"{kind.upper()} vs 1-bit {kind.upper()} ({report['world_size']} ranks)")
        ax.set_xlabel("step")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("validation cross-entropy (nats/char)")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "convergence.png"), dpi=120)
    print(f"wrote {os.path.join(out, 'convergence.png')}")


def print_report(report: dict[str, Any]) -> None:
    print(f"{'run':12s} {'final val':>10s} {'bytes/rank':>14s} {'vs fp32 Adam':>13s}")
    for r in report["runs"]:
        red = r.get("bytes_reduction_vs_fp32_adam")
        print(f"{r['name']:12s} {r['final_val_loss']:10.4f} {r['bytes_sent']:14,d} "
              f"{'' if red is None else f'{red:12.2f}x'}")
    for k, v in report["summary"].items():
        print(f"{k}: {v:.3f}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if launch.launcher() == "torchrun":
        dist.init_process_group("gloo")
        results = rank_main(args)
        if dist.get_rank() == 0:
            report = summarize(results, args, dist.get_world_size())
            print_report(report)
            write_outputs(report, args.out)
        dist.destroy_process_group()
        return
    results = launch.spawn(_spawned, args.world_size, args)[0]
    report = summarize(results, args, args.world_size)
    print_report(report)
    write_outputs(report, args.out)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()

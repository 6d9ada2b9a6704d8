"""Convergence of the compressed optimizers against their uncompressed selves, on real text.

Two tasks, data-parallel over local gloo ranks that this program spawns itself (or under
torchrun), each rank drawing its own minibatches of windows of text:

    --task char-mlp      a character-level MLP language model (embedding of a fixed context
                         window -> MLP -> next character) on Python's own standard-library
                         sources (read from the local installation)
    --task transformer   a small causal transformer (2 layers, next character at every
                         position) on the English prose of Python's help topics
                         (`pydoc_data.topics`, shipped with Python)

Nothing is downloaded (the tasks are bench/tasks.py's). Five runs with identical data and
initial model:

    adam          OnebitAdam with freeze_step = steps  (never compresses: fp32 allreduce Adam)
    onebit_adam   OnebitAdam with freeze_step = warm-up fraction * steps
    lamb          OnebitLamb with freeze_step = steps
    onebit_lamb   OnebitLamb with freeze_step = warm-up fraction * steps
    zeroone       ZeroOneAdam (0/1 Adam), var_freeze_step = warm-up fraction * steps; its
                  uncompressed baseline is adam

and, asked for by name (`--runs adam,diloco_h16,diloco_exact_h16,...`), DiLoCo around AdamW with
adam's schedule and its learning rate (or `--lr-diloco`'s), adam's every step being data-parallel
AdamW over an fp32 allreduce (what DDP + AdamW computes):

    diloco_hH        compcomm.optim.DiLoCo, sync_every = H (8, 16 or 32), 1-bit error-feedback
                     pseudo-gradients; baselines adam and diloco_exact_hH
    diloco_exact_hH  the same with the exact mean of the pseudo-gradients

(`--diloco-passes P --diloco-passes-until T`: the 1-bit runs send the syncs up to step T in P
1-bit calls each, DiLoCo's `passes` and `passes_until`; `--diloco-rotate`: the 1-bit runs
rotate each bucket before its calls, DiLoCo's `rotate`.)

A DiLoCo run is evaluated on its synced parameters (`opt.global_parameters()`, the same on every
rank), and its last step is followed by `opt.sync()`, which syncs the inner steps taken since the
last scheduled sync (its bytes are counted), so that the final model holds every step.

It prints the final validation losses, the gaps to the baselines, and the bytes each rank
handed to the transport (backend.bytes_sent), and writes `convergence[_TASK][_TAG].json` and
`.png` (matplotlib, optional) to `--out DIR`, by default to a new directory under the system's
temporary directory (printed), so that a trial run never replaces the recorded results: those
were made with `--out bench/results` (bench/results/convergence*.cmd).

    python bench/convergence.py                              # char-mlp, 4 ranks, a few minutes
    python bench/convergence.py --task transformer --out results/
    torchrun --nproc-per-node 4 bench/convergence.py
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import tempfile
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from sharding import host_groups, shard_children

from ranks import add_nprocs_argument, run_ranks
from records import output_dir, write_json
from tasks import TASKS, load_text, random_windows, task_model

if TYPE_CHECKING:
    from compcomm.backends import Backend

RUNS = {  # name: (optimizer, compressed, uncompressed baseline)
    "adam": ("adam", False, None),
    "onebit_adam": ("adam", True, "adam"),
    "lamb": ("lamb", False, None),
    "onebit_lamb": ("lamb", True, "lamb"),
    "zeroone": ("zeroone", True, "adam"),
}
DEFAULT_RUNS = list(RUNS)
for _mode in ("fsdp", "hsdp"):  # sharded training: FSDP2 over all ranks, or HSDP over 2 replicas
    RUNS[f"{_mode}_adam"] = (f"{_mode}_adam", False, None)
    RUNS[f"{_mode}_onebit_adam"] = (f"{_mode}_adam", True, f"{_mode}_adam")
    RUNS[f"{_mode}_sgd"] = (f"{_mode}_sgd", False, None)
    RUNS[f"{_mode}_onebit_sgd"] = (f"{_mode}_sgd", True, f"{_mode}_sgd")
SHARDED_RUNS = [name for name in RUNS if name.startswith(("fsdp_", "hsdp_"))]
DILOCO_H = (8, 16, 32)
for _h in DILOCO_H:
    RUNS[f"diloco_exact_h{_h}"] = ("diloco", False, "adam")
    RUNS[f"diloco_h{_h}"] = ("diloco", True, "adam")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--task", choices=list(TASKS), default="char-mlp")
    add_nprocs_argument(ap, "--world-size")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--warmup", type=float, default=0.15, help="fraction of steps before compression")
    ap.add_argument("--batch", type=int, default=32, help="sequences per rank per step")
    ap.add_argument("--context", type=int, default=16, help="characters of context")
    ap.add_argument("--embed", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--lr-adam", type=float, default=3e-3)
    ap.add_argument("--lr-lamb", type=float, default=1e-2)
    ap.add_argument(
        "--lr-diloco", type=float, default=None, help="DiLoCo's inner AdamW learning rate (default: --lr-adam)"
    )
    ap.add_argument("--lr-sgd", type=float, default=0.05, help="SGD with momentum 0.9 (the FSDP/HSDP sgd runs)")
    ap.add_argument(
        "--var-update-scaler",
        type=int,
        default=16,
        help="ZeroOneAdam's var_update_scaler (default: DeepSpeed's default, 16)",
    )
    ap.add_argument(
        "--local-step-scaler",
        type=int,
        default=None,
        help="ZeroOneAdam's local_step_scaler (default: from the learning-rate schedule, see lr_policy_scaler)",
    )
    ap.add_argument(
        "--local-step-clipper",
        type=int,
        default=16,
        help="ZeroOneAdam's local_step_clipper (default: DeepSpeed's default, 16)",
    )
    ap.add_argument(
        "--schedule",
        choices=["cosine", "constant"],
        default="cosine",
        help="learning rate: cosine decay to 10%% over the run, or constant",
    )
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--text-bytes", type=int, default=1_000_000, help="characters of text to use")
    ap.add_argument("--val-windows", type=int, default=4096)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--outer-lr", type=float, default=0.7, help="DiLoCo's outer learning rate (default 0.7)")
    ap.add_argument("--outer-momentum", type=float, default=0.9, help="DiLoCo's outer Nesterov momentum (default 0.9)")
    ap.add_argument("--no-nesterov", dest="nesterov", action="store_false", help="DiLoCo's outer SGD without Nesterov")
    ap.add_argument(
        "--diloco-bucket-kb",
        type=int,
        default=None,
        help="DiLoCo's communication buckets, KiB (default 25 MiB: one bucket for these models)",
    )
    ap.add_argument(
        "--diloco-passes",
        type=int,
        default=1,
        help="1-bit calls per sync of the compressed DiLoCo runs (DiLoCo's passes, default 1)",
    )
    ap.add_argument(
        "--diloco-passes-until",
        type=int,
        default=None,
        help="the last step whose sync takes --diloco-passes calls (DiLoCo's passes_until; default: every sync)",
    )
    ap.add_argument(
        "--diloco-rotate",
        action="store_true",
        help="the compressed DiLoCo runs rotate each bucket before its 1-bit calls (DiLoCo's rotate)",
    )
    ap.add_argument("--runs", default=",".join(DEFAULT_RUNS), help="comma-separated subset of " + ",".join(RUNS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--out",
        type=output_dir,
        default=None,
        metavar="DIR",
        help="directory of the report (made if missing; default: a new one under the system's temporary directory)",
    )
    ap.add_argument("--tag", default="", help="appended to the output files' names (e.g. for a variant)")
    args = ap.parse_args(argv)
    unknown = set(args.runs.split(",")) - set(RUNS)
    if unknown:
        ap.error(f"unknown runs {sorted(unknown)}")
    for flag in ("steps", "eval_every"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    if not 0 <= args.warmup < 1:
        ap.error(f"--warmup is a fraction of the steps, in [0, 1), got {args.warmup}")
    if args.local_step_scaler is None:
        args.local_step_scaler = lr_policy_scaler(args)
    return args


def freeze_step(args: argparse.Namespace) -> int:
    """The last uncompressed (1-bit Adam/LAMB) or variance-refreshing (0/1 Adam) step."""
    return max(1, round(args.warmup * args.steps))


def lr_factor(args: argparse.Namespace, step: int) -> float:
    """The learning rate after `step` scheduler steps, as a fraction of the peak."""
    if args.schedule == "constant":
        return 1.0
    return 0.1 + 0.45 * (1 + math.cos(math.pi * min(step, args.steps) / args.steps))


def lr_policy_scaler(args: argparse.Namespace) -> int:
    """ZeroOneAdam's local_step_scaler by 0/1 Adam's learning-rate policy (Lu et al. 2022, section 6;
    DeepSpeed's docs say to pre-calculate it from the schedule): the local-step interval doubles
    each time the learning rate halves, so that interval * lr, how far a rank walks alone, stays
    about what it was at the freeze. With a fixed doubling period, that is the number of steps
    in which the rate halves on average over the compression stage; a rate that never halves
    never lengthens the interval (a period beyond the run)."""
    freeze = freeze_step(args)
    halvings = math.log2(lr_factor(args, freeze) / lr_factor(args, args.steps))
    return max(1, round((args.steps - freeze) / halvings)) if halvings > 0 else args.steps + 1


# ------------------------------------------------------------------ one rank


def make_optimizer(
    name: str, model: torch.nn.Module, args: argparse.Namespace, backend: Backend
) -> torch.optim.Optimizer:
    """Run `name`'s optimizer: its baseline never leaves the fp32 warm-up (freeze at the last step)."""
    from compcomm.layout import DEFAULT_BUCKET_BYTES
    from compcomm.optim import DiLoCo, OnebitAdam, OnebitLamb, ZeroOneAdam

    kind, compressed, _ = RUNS[name]
    if kind.endswith("_sgd"):
        return torch.optim.SGD(model.parameters(), lr=args.lr_sgd, momentum=0.9, weight_decay=args.weight_decay)
    if kind == "diloco":
        inner = torch.optim.AdamW(model.parameters(), lr=diloco_inner_lr(args), weight_decay=args.weight_decay)
        return DiLoCo(
            model.parameters(),
            inner,
            sync_every=diloco_h(name),
            outer_lr=args.outer_lr,
            outer_momentum=args.outer_momentum,
            nesterov=args.nesterov,
            compress=compressed,
            backend=backend,
            bucket_bytes=DEFAULT_BUCKET_BYTES if args.diloco_bucket_kb is None else args.diloco_bucket_kb * 1024,
            passes=args.diloco_passes if compressed else 1,
            passes_until=args.diloco_passes_until,
            rotate=args.diloco_rotate and compressed,
        )
    freeze = freeze_step(args) if compressed else args.steps
    if kind.endswith("adam"):
        return OnebitAdam(
            model.parameters(), lr=args.lr_adam, weight_decay=args.weight_decay, freeze_step=freeze, backend=backend
        )
    if kind == "lamb":
        return OnebitLamb(
            model.parameters(), lr=args.lr_lamb, weight_decay=args.weight_decay, freeze_step=freeze, backend=backend
        )
    return ZeroOneAdam(
        model.parameters(),
        lr=args.lr_adam,
        weight_decay=args.weight_decay,
        var_freeze_step=freeze,
        var_update_scaler=args.var_update_scaler,
        local_step_scaler=args.local_step_scaler,
        local_step_clipper=args.local_step_clipper,
        backend=backend,
    )


def shard(model: torch.nn.Module, name: str, args: argparse.Namespace) -> Any:
    """fully_shard the model's trained children and the model (FSDP over every rank,
    or HSDP: 2 replicas of world/2 shards) and compress its gradient reduction: 1-bit after the
    warm-up for the compressed runs, exact throughout for their baselines. Returns the state,
    whose `bytes_sent` counts the reduction's bytes."""
    from torch.distributed.device_mesh import DeviceMesh

    import compcomm

    replicate = None
    if name.startswith("hsdp"):
        shard, replicate = host_groups(dist.get_world_size() // 2)
        mesh = DeviceMesh.from_group(shard, "cpu")
    else:
        mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    shard_children(model, mesh)
    start = freeze_step(args) if RUNS[name][1] else args.steps
    return compcomm.fsdp.compress(model, start_iter=start, replicate_group=replicate)


def diloco_inner_lr(args: argparse.Namespace) -> float:
    """DiLoCo's inner AdamW learning rate: --lr-diloco, else adam's (the same schedule either way)."""
    return args.lr_adam if args.lr_diloco is None else args.lr_diloco


def diloco_h(name: str) -> int:
    """The sync interval H of a DiLoCo run's name (diloco_h16, diloco_exact_h16)."""
    return int(name.rsplit("_h", 1)[1])


def run_one(name: str, args: argparse.Namespace, train: torch.Tensor, val: torch.Tensor, rank: int) -> dict[str, Any]:
    """Train run `name` from the common initial model on this rank's minibatches of `train`;
    its validation curve on `val`, bytes sent and what it ran with."""
    import compcomm

    torch.manual_seed(args.seed)  # the same initial model on every rank and in every run
    model = task_model(args.task, args.context, args.embed, args.hidden)
    backend = compcomm.backends.get("gloo")
    counted: Any = backend  # what counts the run's bytes (`bytes_sent`)
    if name in SHARDED_RUNS:  # FSDP moves the gradients; compcomm's bytes are the gradient reduction's
        counted = shard(model, name, args)
    opt = make_optimizer(name, model, args, backend)
    if args.schedule == "cosine":
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(args, s))
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + rank)  # same batches in every run
    curve, t0 = [], time.perf_counter()
    for step in range(1, args.steps + 1):
        batch = random_windows(train, args.batch, args.context, gen)
        model.zero_grad(set_to_none=True)
        loss = model.loss(batch)
        loss.backward()
        opt.step()
        if args.schedule == "cosine":
            sched.step()
        if step == args.steps and hasattr(opt, "global_parameters"):
            opt.sync()  # DiLoCo: the inner steps since the last scheduled sync
        if step % args.eval_every == 0 or step == args.steps:
            curve.append(
                {
                    "step": step,
                    "train_loss": loss.item(),
                    "val_loss": evaluate(model, val, opt),
                    "bytes_sent": counted.bytes_sent,
                }
            )
    return {
        "name": name,
        "optimizer": type(opt).__name__,
        "freeze_step": getattr(opt, "freeze_step", getattr(opt, "var_freeze_step", None)),
        "sync_every": getattr(opt, "sync_every", None),
        "lr": opt.defaults["lr"],
        "final_val_loss": curve[-1]["val_loss"],
        "bytes_sent": counted.bytes_sent,
        "seconds": time.perf_counter() - t0,
        "curve": curve,
        "skipped_steps": getattr(opt, "skipped_steps", 0),
        "skipped_syncs": getattr(opt, "skipped_syncs", None),
        "params": sum(p.numel() for p in model.parameters()),
        "buckets": len(getattr(opt, "error_feedback", ())),
    }


@torch.no_grad()
def evaluate(model: torch.nn.Module, val: torch.Tensor, opt: torch.optim.Optimizer) -> float:
    """The model's mean loss over the validation windows; for DiLoCo, that of its synced
    parameters (the shared model), put in the model for the evaluation only."""
    if not hasattr(opt, "global_parameters"):
        return float(model.loss(val))
    local = [p.detach().clone() for p in model.parameters()]
    for p, synced in zip(model.parameters(), opt.global_parameters()):
        p.copy_(synced)
    try:
        return float(model.loss(val))
    finally:
        for p, mine in zip(model.parameters(), local):
            p.copy_(mine)


def rank_main(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every requested run on this rank, one after the other: the first 90% of the corpus
    trains, fixed windows of the rest validate."""
    torch.set_num_threads(1)
    rank = dist.get_rank()
    text = load_text(args.task, args.text_bytes)
    split = int(len(text) * 0.9)
    val = random_windows(text[split:], args.val_windows, args.context, torch.Generator().manual_seed(12345))
    results = []
    for name in args.runs.split(","):
        res = run_one(name, args, text[:split], val, rank)
        if rank == 0:
            print(
                f"  {name:16s} final val loss {res['final_val_loss']:.4f}  bytes/rank {res['bytes_sent']:>12,d}"
                f"  {res['seconds']:.1f}s",
                flush=True,
            )
        results.append(res)
    return results


# ------------------------------------------------------------------ report


def summarize(results: list[dict[str, Any]], args: argparse.Namespace, world: int) -> dict[str, Any]:
    """The report: every run, each compressed run's gap to its baseline, bytes against fp32
    Adam's, and what it all ran with."""
    by = {r["name"]: r for r in results}
    summary: dict[str, Any] = {}
    for name, (_, _, base) in RUNS.items():
        bases = [base] + ([name.replace("diloco_h", "diloco_exact_h")] if name.startswith("diloco_h") else [])
        for b_name in bases:
            if b_name in by and name in by:
                b, o = by[b_name]["final_val_loss"], by[name]["final_val_loss"]
                summary[f"{name}_vs_{b_name}_gap_pct"] = 100.0 * (o - b) / b
    if "adam" in by:
        for r in results:
            r["bytes_reduction_vs_fp32_adam"] = by["adam"]["bytes_sent"] / r["bytes_sent"]
    if "zeroone" in by and "onebit_adam" in by:
        summary["onebit_adam_bytes_over_zeroone_bytes"] = by["onebit_adam"]["bytes_sent"] / by["zeroone"]["bytes_sent"]
    warm = freeze_step(args) / args.steps  # the warm-up as run: --warmup of the steps, at least one
    summary["expected_onebit_reduction_at_warmup"] = 1.0 / (warm + (1 - warm) / 32)
    return {
        "diverged": [r["name"] for r in results if not math.isfinite(r["final_val_loss"])],
        "task": TASKS[args.task],
        "world_size": world,
        "backend": "gloo",
        "args": {k: v for k, v in vars(args).items() if k != "out"},
        "host": platform.node(),
        "torch": torch.__version__,
        "summary": summary,
        "runs": results,
    }


def write_outputs(report: dict[str, Any], out: str) -> None:
    """convergence[_TASK][_TAG].json in `out`, and the loss curves beside it (.png) when
    matplotlib is installed."""
    stem = "convergence" if report["args"]["task"] == "char-mlp" else f"convergence_{report['args']['task']}"
    stem += f"_{report['args']['tag']}" if report["args"]["tag"] else ""
    write_json(report, os.path.join(out, f"{stem}.json"))
    print(f"wrote {os.path.join(out, stem + '.json')}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed (pip install compcomm[plot]): no plot")
        return
    present = [family(r["name"]) for r in report["runs"]]
    families = list(dict.fromkeys(present))  # one column per family, in the order they ran
    if "diloco" in families and present.count("adam") == 1:
        families.remove("adam")  # adam alone: it is drawn in the DiLoCo column
    fig, axes = plt.subplots(2, len(families), figsize=(max(7.0, 5.5 * len(families)), 8), sharey=True, squeeze=False)
    for column, fam in enumerate(families):
        for r in report["runs"]:
            # the DiLoCo column repeats adam, the data-parallel run it is measured against
            if family(r["name"]) != fam and not (fam == "diloco" and r["name"] == "adam"):
                continue
            label = f"{r['name']} (val {r['final_val_loss']:.3f}, {r['bytes_sent'] / 2**20:.2f} MiB/rank)"
            style = "-" if RUNS[r["name"]][2] is None or "exact" in r["name"] else "--"
            for row, x in enumerate(([c["step"] for c in r["curve"]], [c["bytes_sent"] / 2**20 for c in r["curve"]])):
                axes[row][column].plot(x, [c["val_loss"] for c in r["curve"]], style, label=label)
        axes[0][column].set_title(f"{fam.upper()} family ({report['world_size']} ranks)")
        axes[0][column].set_xlabel("step")
        axes[1][column].set_xlabel("MiB sent per rank")
        axes[1][column].set_xscale("log")
        for row in range(2):
            if axes[row][column].get_legend_handles_labels()[0]:
                axes[row][column].legend(fontsize=7)
            axes[row][column].grid(alpha=0.3)
    for row in range(2):
        axes[row][0].set_ylabel("validation cross-entropy (nats/char)")
    fig.suptitle(report["task"])
    fig.tight_layout()
    fig.savefig(os.path.join(out, f"{stem}.png"), dpi=110)
    print(f"wrote {os.path.join(out, stem + '.png')}")


def family(name: str) -> str:
    """The plot column of a run: its optimizer's family (DiLoCo runs together)."""
    kind, _, base = RUNS[name]
    return "diloco" if kind == "diloco" else base or name


def print_report(report: dict[str, Any]) -> None:
    """Final losses and bytes per run, then the summary's ratios."""
    print(f"{'run':16s} {'final val':>10s} {'bytes/rank':>14s} {'vs fp32 Adam':>13s}")
    for r in report["runs"]:
        red = r.get("bytes_reduction_vs_fp32_adam")
        print(
            f"{r['name']:16s} {r['final_val_loss']:10.4f} {r['bytes_sent']:14,d} "
            f"{'' if red is None else f'{red:12.2f}x'}"
        )
    for k, v in report["summary"].items():
        print(f"{k}: {v:.3f}")
    if report["diverged"]:
        warm = freeze_step(argparse.Namespace(**report["args"]))
        print(
            f"WARNING: {', '.join(report['diverged'])} diverged (a non-finite final validation loss), so the gaps "
            f"involving them are nan. The warm-up ran {warm} of {report['args']['steps']} steps; the 1-bit "
            "optimizers estimate their second moment there, and too short a one can make them diverge: "
            "run more --steps, or a larger --warmup."
        )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    results, world = run_ranks(rank_main, args, args.world_size)
    if results is not None:
        report = summarize(results, args, world)
        print_report(report)
        write_outputs(report, args.out or tempfile.mkdtemp(prefix="convergence-"))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()

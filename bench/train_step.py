#!/usr/bin/env python3
"""Whole training steps, side by side: what a data-parallel user would pick against compcomm.

    python bench/train_step.py                                   # spawns 4 local gloo ranks
    torchrun --nproc-per-node 4 bench/train_step.py
    mpirun -n 4 python bench/train_step.py --backend mpi         # compcomm's collectives over MPI
    python bench/netsim.py --hosts 4 --rate 1gbit -- python bench/train_step.py --json out.json
    python bench/train_step.py --compute-heavy                   # the compute-bound end
    python bench/train_step.py --plot curves.png --methods ddp_sgd,ddp_sgd_onebit --steps 400 ...

Every method trains the same model from the same initial weights on the same batches (each rank
its own), one after the other in the same processes (METHODS below; `--methods` picks some):

    ddp_adamw            DDP + torch.optim.AdamW (fp32 ring allreduce of every gradient)
    ddp_adamw_bf16       DDP + AdamW + torch's bf16_compress_hook
    ddp_adamw_powersgd   DDP + AdamW + torch's PowerSGD hook, rank 4, error feedback, warm start.
                         In ONE DDP bucket: with 2+ buckets the PowerSGD hook deadlocks on gloo.
                         On a machine with a GPU the hook fails on this CPU training (torch 2.11 and
                         2.13 synchronize a CUDA device with the CPU one): run with CUDA_VISIBLE_DEVICES=
    ddp_sgd              DDP + SGD with momentum (the uncompressed baseline of the 1-bit hook)
    ddp_sgd_onebit       DDP + SGD with momentum + compcomm.ddp.onebit_hook
    ddp_sgd_onebit_propagate  the same hook with nonfinite="propagate" (for GradScaler: each
                         iteration's errors go into spare buffers, kept once every bucket succeeded)
    onebit_adam          compcomm.optim.OnebitAdam (no DDP: the optimizer communicates)
    onebit_lamb          compcomm.optim.OnebitLamb
    zeroone_adam         compcomm.optim.ZeroOneAdam, when this build of compcomm has it (else skipped)
    diloco               compcomm.optim.DiLoCo around AdamW: each rank steps alone, the ranks sync
                         every --sync-every steps with 1-bit error-feedback pseudo-gradients (in
                         --diloco-fragments staggered fragments; no warm-up: it starts syncing at once)
    diloco_exact         the same with the exact mean of the pseudo-gradients
    diloco_rotate        diloco with each bucket rotated before its 1-bit call (DiLoCo(rotate=True))
    fsdp_adamw           FSDP2 (fully_shard over every rank) + AdamW, FSDP's own collectives
    fsdp_onebit_adam     FSDP2 + compcomm.fsdp.compress (1-bit reduce-scatter) + sharded OnebitAdam
    fsdp_onebit_sgd      FSDP2 + compcomm.fsdp.compress + SGD with momentum
    hsdp_adamw           HSDP on FSDP2's 2-D mesh (shards inside a host, replicas across hosts) + AdamW
    hsdp_onebit_adam     HSDP: shards inside a host, compcomm.fsdp.compress(replicate_group=...)
                         averages each shard across hosts in 1 bit; sharded OnebitAdam
    hsdp_onebit_sgd      the same with SGD with momentum

The first --warmup-steps steps are the warm-up stage of the staged methods (PowerSGD's
start_powerSGD_iter, the hook's start_iter, the optimizers' freeze_step); the others use them to
warm up too. Reported per method: median step time over the steps after the warm-up (the
compression stage) and over the warm-up steps (the first step, with its allocations and DDP's
bucket rebuild, left out). With --steps <= --warmup-steps (the warm-up alone, measured) the staged
methods have no compression-stage figures ("-", null in the JSON); the others report every step.
Every step starts on all ranks together (a barrier before the timed
region), so the first step's one-time costs, which vary by rank, do not spill into the second
through ranks waiting for the slowest one. Also reported: bytes this rank handed to the transport
per step in each stage (compcomm backends count them; for torch's hooks the benchmark counts what
they pass to torch.distributed.all_reduce, and for plain DDP it is 2(n-1)/n of the fp32 gradients,
all with the same ring accounting as compcomm's backends); the final loss (mean over ranks of the
training loss over the last tenth of the steps); the time to reach DDP + AdamW's final loss, where
reached (the running mean over the same window, against the summed step times). For DDP + AdamW it
also times the same step with no communication at all (each rank alone) and reports the fraction of
DDP's step spent communicating: 1 - t(alone) / t(DDP). For compcomm's optimizers, the fraction of
their collectives' time hidden behind backward (`last_comm_timing`: the time their collectives ran
before backward ended over the whole time they ran, summed over the stage's steps and averaged over
ranks), in each stage.

Every Adam/LAMB method uses --eps (default 1e-4, not torch's 1e-8): a 5-step warm-up leaves some
second moments near 1e-12, and 1-bit Adam/LAMB, whose compressed momentum has one magnitude per
chunk, divide by their frozen square root and diverge within a few steps at eps=1e-8 (1-bit Adam
is meant for warm-ups of thousands of steps). The same eps for AdamW keeps the race fair.

The default model (a ~11M-parameter character MLP with small batches) is in the communication-
bound regime of the 1-bit papers; --compute-heavy uses a ~9x smaller model with 128x the batch.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from sharding import host_groups, shard_children
from torch.nn.parallel import DistributedDataParallel as DDP

import emulation
from ranks import add_nprocs_argument, launch_label, launched_world, mpirun_needed, run_ranks, set_threads
from records import codec_line, make_parent, output_path, write_json
from tasks import CharMLP, load_text, random_windows

RECORD_KEYS = ("method", "world_size", "step_time_ms", "bytes_per_step", "final_loss", "steps")
SETTINGS = {  # name: (context, embed, hidden, batch per rank)
    "comm-bound": (32, 32, 2816, 8),
    "compute-heavy": (32, 32, 704, 1024),
}


# ---------------------------------------------------------------------------------------------
# methods: one entry each


@dataclass
class Run:
    """What one method trains with. `bytes_sent()` is this rank's running count of bytes handed
    to the transport; `fixed_bytes` is added per step where nothing counts them (plain DDP);
    `counting` wraps the steps (for the counter of torch's hooks); `comm_timing()` is the last
    step's (busy, hidden) collective seconds, where the method measures them."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    bytes_sent: Callable[[], float] = lambda: 0.0
    fixed_bytes: float = 0.0
    counting: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    comm_timing: Callable[[], tuple[float, float] | None] = lambda: None


Builder = Callable[[torch.nn.Module, argparse.Namespace], Run]


def ring_bytes(numel: int, element_size: int, world: int) -> float:
    """Bytes one rank hands to a ring allreduce (the accounting of compcomm's backends)."""
    return 2 * (world - 1) * numel * element_size / world


class AllReduceCounter:
    """Counts the bytes torch's own hooks pass to torch.distributed.all_reduce while active."""

    def __init__(self) -> None:
        self.bytes = 0.0

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        original = dist.all_reduce

        def counted(tensor, *args, **kwargs):
            group = kwargs.get("group", args[1] if len(args) > 1 else None)
            self.bytes += ring_bytes(tensor.numel(), tensor.element_size(), dist.get_world_size(group))
            return original(tensor, *args, **kwargs)

        dist.all_reduce = counted
        try:
            yield
        finally:
            dist.all_reduce = original


def adamw(params, args: argparse.Namespace) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=args.lr_adam, eps=args.eps, weight_decay=0.0)


def sgd(params, args: argparse.Namespace) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=args.lr_sgd, momentum=0.9)


def bf16_hook(process_group, bucket):  # no annotations: DDP rejects this module's string ones
    """torch's bf16_compress_hook under another name: DDP refuses that name on CPU-only torch."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

    return bf16_compress_hook(process_group, bucket)


def ddp_method(optimizer: Callable, hook: str | None = None, nonfinite: str = "raise") -> Builder:
    """DDP with `optimizer` and no hook, or hook "bf16", "powersgd" or "onebit" (with the
    hook state's `nonfinite` mode)."""

    def build(model: torch.nn.Module, args: argparse.Namespace) -> Run:
        # PowerSGD runs in one bucket: with 2+ DDP buckets its hook deadlocks on gloo.
        ddp = DDP(model, bucket_cap_mb=1 << 14 if hook == "powersgd" else args.bucket_mb)
        opt = optimizer(ddp.parameters(), args)
        if hook is None:
            numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
            return Run(ddp, opt, fixed_bytes=ring_bytes(numel, 4, dist.get_world_size()))
        if hook == "onebit":
            import compcomm.ddp

            state = compcomm.ddp.OnebitHookState(
                start_iter=args.warmup_steps, nonfinite=nonfinite, backend=compcomm_backend(args)
            )
            ddp.register_comm_hook(state, compcomm.ddp.onebit_hook)
            return Run(ddp, opt, lambda: float(state.backend().bytes_sent))
        counter = AllReduceCounter()
        if hook == "bf16":
            ddp.register_comm_hook(None, bf16_hook)
        else:
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

            state = powersgd.PowerSGDState(
                process_group=None,
                matrix_approximation_rank=4,
                start_powerSGD_iter=max(2, args.warmup_steps),
                use_error_feedback=True,
                warm_start=True,
            )
            ddp.register_comm_hook(state, powersgd.powerSGD_hook)
        return Run(ddp, opt, lambda: counter.bytes, counting=counter.active)

    return build


def compcomm_backend(args: argparse.Namespace):
    """The backend of compcomm's own collectives (the 1-bit hook, the optimizers, DiLoCo):
    `--backend`, over the ranks of the gloo group that torch's DDP and FSDP use either way."""
    import compcomm

    return compcomm.backends.get(args.backend)


def compcomm_optimizer(name: str, stage_arg: str, lr_arg: str = "lr_adam") -> Builder:
    """compcomm.optim.<name> (the model is not wrapped: the optimizer communicates), with the
    warm-up length passed as `stage_arg`."""

    def build(model: torch.nn.Module, args: argparse.Namespace) -> Run:
        import compcomm
        import compcomm.optim

        backend = compcomm_backend(args)
        trained = [p for p in model.parameters() if p.requires_grad]
        opt = getattr(compcomm.optim, name)(
            trained, lr=getattr(args, lr_arg), eps=args.eps, backend=backend, **{stage_arg: args.warmup_steps}
        )

        def timing() -> tuple[float, float] | None:
            last = getattr(opt, "last_comm_timing", None)  # absent from older builds
            return None if last is None else (last.busy, last.hidden)

        return Run(model, opt, lambda: float(backend.bytes_sent), comm_timing=timing)

    build.requires = name  # type: ignore[attr-defined]
    return build


def diloco_method(compress: bool, rotate: bool = False) -> Builder:
    """compcomm.optim.DiLoCo around AdamW (the model is not wrapped), every --sync-every steps."""

    def build(model: torch.nn.Module, args: argparse.Namespace) -> Run:
        from compcomm.optim import DiLoCo

        backend = compcomm_backend(args)
        trained = [p for p in model.parameters() if p.requires_grad]
        opt = DiLoCo(
            trained,
            adamw(trained, args),
            sync_every=args.sync_every,
            compress=compress,
            rotate=rotate,
            fragments=args.diloco_fragments,
            backend=backend,
            bucket_bytes=bucket_bytes(args),  # None: DiLoCo sizes them for its fragments
        )
        return Run(model, opt, lambda: float(backend.bytes_sent))

    build.requires = "DiLoCo"  # type: ignore[attr-defined]
    return build


def sharded_method(mode: str, optimizer: str, compress: bool) -> Builder:
    """FSDP2 over every rank ("fsdp") or HSDP ("hsdp": sharded inside each host of
    LOCAL_WORLD_SIZE ranks, replicated across hosts), with torch's AdamW and FSDP's own exact
    collectives (compress=False: for HSDP, FSDP's native 2-D mesh), or under
    compcomm.fsdp.compress (the reduce-scatter, or the average across hosts, in 1 bit after the
    warm-up) with the sharded OnebitAdam ("onebit_adam") or SGD with momentum ("sgd"). compcomm's
    HSDP moves FSDP's collectives inside a host through shared memory (`--hsdp-intra shm`, the
    default: what compcomm does inside a CPU node) or leaves them on FSDP's gloo group
    (`--hsdp-intra fsdp`); its warm-up steps are then the exact reduction with the same intra-host
    transport, which separates what the transport buys from what 1 bit buys.

    Bytes per step are those of the gradient reduction that compcomm compresses: the
    reduce-scatter over all ranks (FSDP), or the all-reduce across hosts (HSDP, the traffic that
    crosses hosts); measured for compcomm's, the ring accounting of the same tensors for FSDP's.
    FSDP's parameter all-gathers stay fp32 in every method and are not counted."""

    def build(model: torch.nn.Module, args: argparse.Namespace) -> Run:
        from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

        import compcomm
        import compcomm.optim

        world = dist.get_world_size()
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        if mode == "fsdp":
            k = world  # one shard group: every rank
        else:  # the ranks of a host shard; on a single host, two halves stand for two hosts
            k = local if local < world else world // 2
        hosts = world // k
        shard, replica = host_groups(k)
        if mode == "hsdp" and not compress:
            mesh = init_device_mesh("cpu", (hosts, k), mesh_dim_names=("replicate", "shard"))
        else:
            mesh = DeviceMesh.from_group(shard if mode == "hsdp" else dist.group.WORLD, "cpu")
        shard_children(model, mesh)
        trained = [p for p in model.parameters() if p.requires_grad]
        shard_numel = sum(p.to_local().numel() for p in trained)
        if mode == "hsdp":
            exact_bytes = ring_bytes(shard_numel, 4, hosts)  # each rank all-reduces its shard across hosts
        else:
            exact_bytes = (world - 1) * shard_numel * 4.0  # reduce-scatter: (n-1)/n of the padded gradient
        if not compress:
            return Run(model, adamw(trained, args), fixed_bytes=exact_bytes)
        hsdp = mode == "hsdp"
        state = compcomm.fsdp.compress(
            model,
            start_iter=args.warmup_steps,
            replicate_group=replica if hsdp else None,
            intra="shm" if hsdp and args.hsdp_intra == "shm" else None,
        )
        if optimizer == "sgd":
            opt: torch.optim.Optimizer = sgd(trained, args)
        else:
            opt = compcomm.optim.OnebitAdam(trained, lr=args.lr_adam, eps=args.eps, freeze_step=args.warmup_steps)
        return Run(model, opt, lambda: float(state.bytes_sent))

    return build


def alone(model: torch.nn.Module, args: argparse.Namespace) -> Run:
    """DDP + AdamW's step without any communication (each rank on its own): its compute time."""
    return Run(model, adamw(model.parameters(), args))


FROZEN_AFTER_WARMUP = {"onebit_adam", "onebit_lamb", "zeroone_adam", "fsdp_onebit_adam", "hsdp_onebit_adam"}
"""The methods whose optimizer freezes its variance after the warm-up, which must be a step at least."""

STAGED = FROZEN_AFTER_WARMUP | {
    "ddp_adamw_powersgd",
    "ddp_sgd_onebit",
    "ddp_sgd_onebit_propagate",
    "fsdp_onebit_sgd",
    "hsdp_onebit_sgd",
}
"""The methods that run uncompressed for the --warmup-steps steps, then compress: their step time
and bytes per step are those of the steps after the warm-up, and a run of no more steps than the
warm-up (a measure of the warm-up alone) has none to report."""

METHODS: dict[str, Builder] = {
    "ddp_adamw": ddp_method(adamw),
    "ddp_adamw_bf16": ddp_method(adamw, "bf16"),
    "ddp_adamw_powersgd": ddp_method(adamw, "powersgd"),
    "ddp_sgd": ddp_method(sgd),
    "ddp_sgd_onebit": ddp_method(sgd, "onebit"),
    "ddp_sgd_onebit_propagate": ddp_method(sgd, "onebit", nonfinite="propagate"),
    "onebit_adam": compcomm_optimizer("OnebitAdam", "freeze_step"),
    "onebit_lamb": compcomm_optimizer("OnebitLamb", "freeze_step", "lr_lamb"),
    "zeroone_adam": compcomm_optimizer("ZeroOneAdam", "var_freeze_step"),
    "diloco": diloco_method(compress=True),
    "diloco_exact": diloco_method(compress=False),
    "diloco_rotate": diloco_method(compress=True, rotate=True),
    "fsdp_adamw": sharded_method("fsdp", "adamw", compress=False),
    "fsdp_onebit_adam": sharded_method("fsdp", "onebit_adam", compress=True),
    "fsdp_onebit_sgd": sharded_method("fsdp", "sgd", compress=True),
    "hsdp_adamw": sharded_method("hsdp", "adamw", compress=False),
    "hsdp_onebit_adam": sharded_method("hsdp", "onebit_adam", compress=True),
    "hsdp_onebit_sgd": sharded_method("hsdp", "sgd", compress=True),
}


def skipped_because(name: str, world: int) -> str | None:
    """Why a method cannot run here (None when it can): this build of compcomm lacks what it
    needs (ZeroOneAdam may be missing), or it is HSDP in a world of one rank, which has no
    replicas to reduce across (`--methods` naming one there is refused when parsed)."""
    import compcomm.optim

    requires = getattr(METHODS[name], "requires", "__name__")
    if not hasattr(compcomm.optim, requires):
        return f"compcomm.optim.{requires} is not in this build"
    if name.startswith("hsdp") and world < 2:
        return "HSDP needs at least 2 ranks: shards inside a host, replicas across hosts"
    return None


# ---------------------------------------------------------------------------------------------
# one rank


def make_model(args: argparse.Namespace) -> CharMLP:
    """The common initial model. Its embedding table is fixed (random, not trained): rows of
    characters that the warm-up never saw would have a frozen second moment of ~0, on which
    1-bit Adam/LAMB updates blow up (what DeepSpeed's exp_avg_mask is for); every trained
    parameter here gets a dense gradient."""
    context, embed, hidden, _ = args.shape
    torch.manual_seed(args.seed)
    model = CharMLP(context, embed, hidden)
    model.embed.weight.requires_grad_(False)
    return model


def train(builder: Builder, args: argparse.Namespace, text: torch.Tensor) -> dict[str, list]:
    """Train one method from the common initial weights; this rank's per-step timings, losses
    and cumulative bytes."""
    context, _, _, batch = args.shape
    rank = dist.get_rank()
    run = builder(make_model(args), args)
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + rank)
    times, losses, sent, comm = [], [], [], []
    with run.counting():
        for step in range(args.steps):
            seq = random_windows(text, batch, context, gen)
            dist.barrier()  # a common start: a rank's late end of the last step is not this step's time
            start = time.perf_counter()
            run.optimizer.zero_grad(set_to_none=True)
            loss = torch.nn.functional.cross_entropy(run.model(seq[:, :-1]), seq[:, -1])
            loss.backward()
            run.optimizer.step()
            times.append(emulation.emulated(time.perf_counter() - start))
            losses.append(loss.item())
            sent.append(run.bytes_sent() + run.fixed_bytes * (step + 1))
            comm.append(run.comm_timing())
    return {"times": times, "losses": losses, "sent": sent, "comm": comm}


def rank_main(args: argparse.Namespace, label: str) -> None:
    """Every method on this rank, one after the other; rank 0 reports (`label`: how the ranks
    were started)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    set_threads(world)
    started = time.perf_counter()
    text = load_text("char-mlp", args.text_bytes)
    names = [n for n in args.methods.split(",") if n]
    results: dict[str, dict[str, list] | None] = {}
    for name in names:
        why = skipped_because(name, world)
        if why:
            results[name] = None
            if rank == 0:
                print(f"# {name}: skipped ({why})", flush=True)
            continue
        mine = train(METHODS[name], args, text)
        everyone: list[Any] = [None] * world
        dist.all_gather_object(everyone, mine)
        results[name] = merge(everyone)
        if rank == 0 and not args.quiet:
            print(f"[train_step] {name}: done", file=sys.stderr, flush=True)
    if not args.no_baseline and {"ddp_adamw", "diloco", "diloco_exact", "diloco_rotate"} & set(names):
        everyone = [None] * world
        dist.all_gather_object(everyone, train(alone, args, text))
        results["alone"] = merge(everyone)
    if rank == 0:
        report(results, args, world, label)
        print(f"# all methods ran in {time.perf_counter() - started:.0f} s (after process start-up)")


def merge(per_rank: list[dict[str, list]]) -> dict[str, list]:
    """Per step: the slowest rank's time, the mean loss over ranks, rank 0's bytes, the mean
    (busy, hidden) collective time over ranks (None where not measured)."""
    comm = [
        None if None in c else tuple(statistics.fmean(x) for x in zip(*c)) for c in zip(*(r["comm"] for r in per_rank))
    ]
    return {
        "times": [max(t) for t in zip(*(r["times"] for r in per_rank))],
        "losses": [statistics.fmean(v) for v in zip(*(r["losses"] for r in per_rank))],
        "sent": per_rank[0]["sent"],
        "comm": comm,
    }


def hidden_fraction(comm: list[tuple[float, float] | None], steps: range) -> float | None:
    """Collective time hidden behind backward over the collective time, summed over `steps`."""
    measured = [comm[i] for i in steps if comm[i] is not None]
    busy = sum(c[0] for c in measured)  # type: ignore[index]
    return sum(c[1] for c in measured) / busy if measured and busy > 0 else None  # type: ignore[index]


# ---------------------------------------------------------------------------------------------
# report


def running_mean(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def summarize(name: str, res: dict[str, list], args: argparse.Namespace, world: int) -> dict[str, Any]:
    w, steps = args.warmup_steps, args.steps
    times, sent = res["times"], res["sent"]
    window = max(1, steps // 10)
    per_step = [b - a for a, b in zip([0.0] + sent[:-1], sent)]
    if w < steps:
        compressed = range(w, steps)
    else:  # no step after the warm-up: a staged method has no compression stage, the others every step
        compressed = range(0) if name in STAGED else range(steps)
    warm = range(1, min(w, steps))  # the first step, with its one-time costs, left out
    return {
        "method": name,
        "world_size": world,
        "steps": steps,
        "warmup_steps": w,
        "step_time_ms": 1e3 * statistics.median(times[i] for i in compressed) if compressed else None,
        "mean_step_time_ms": 1e3 * statistics.fmean(times[i] for i in compressed) if compressed else None,
        "warmup_step_time_ms": 1e3 * statistics.median(times[i] for i in warm) if warm else None,
        "bytes_per_step": statistics.fmean(per_step[i] for i in compressed) if compressed else None,
        "warmup_bytes_per_step": statistics.fmean(per_step[i] for i in warm) if warm else None,
        "final_loss": statistics.fmean(res["losses"][-window:]),
        "comm_hidden_fraction": hidden_fraction(res["comm"], compressed),
        "warmup_comm_hidden_fraction": hidden_fraction(res["comm"], warm) if warm else None,
        "loss_curve": res["losses"],
        "step_times_ms": [1e3 * t for t in times],
        "bytes_sent": sent,
    }


def time_to_target(rec: dict[str, Any], target: float, window: int) -> float | None:
    elapsed = 0.0
    for t, mean in zip(rec["step_times_ms"], running_mean(rec["loss_curve"], window)):
        elapsed += t / 1e3
        if mean <= target:
            return elapsed
    return None


def report(results: dict[str, dict | None], args: argparse.Namespace, world: int, label: str) -> None:
    batch = args.shape[3]
    params = sum(p.numel() for p in make_model(args).parameters() if p.requires_grad)
    records = [summarize(n, r, args, world) for n, r in results.items() if r is not None and n != "alone"]
    by = {r["method"]: r for r in records}
    base = by.get("ddp_adamw")
    window = max(1, args.steps // 10)
    for r in records:
        r.update(setting=args.setting, params=params, batch_per_rank=batch, label=label, **emulation.record_fields())
        if r["method"].startswith("diloco"):
            r.update(sync_every=args.sync_every, fragments=args.diloco_fragments)
        if base is not None:
            r["target_loss"] = base["final_loss"]
            r["time_to_target_s"] = time_to_target(r, base["final_loss"], window)
    if results.get("alone"):
        compute = summarize("alone", results["alone"], args, world)["step_time_ms"]
        for r in records:
            r["compute_step_time_ms"] = compute
        if base is not None:
            base["comm_fraction"] = max(0.0, 1.0 - compute / base["step_time_ms"])
    stages = f"{args.warmup_steps} warm-up"
    staged = [r["method"] for r in records if r["method"] in STAGED]
    if args.steps <= args.warmup_steps and staged:  # measuring the warm-up alone
        stages = f"all in the warm-up: no compression stage for {', '.join(staged)}"
    print(
        f"# compcomm train_step: {label}, world size {world}, torch on gloo, compcomm on {args.backend}, "
        f"CharMLP {params / 1e6:.1f}M trained params "
        f"({args.setting}), batch {batch}/rank, {args.steps} steps ({stages})"
    )
    print(codec_line())
    if emulation.label():
        print(f"# times: {emulation.label()} (bench/netsim.py --cpus-per-host, time dilation)")
    print(
        f"# {'method':<24} {'step(ms)':>9} {'warmup(ms)':>10} {'bytes/step':>12} {'warmup B/step':>13} "
        f"{'final_loss':>10} {'to_target(s)':>12} {'hidden%':>7} {'warmup hidden%':>14}"
    )

    def cell(x: float | None, spec: str, scale: float = 1.0) -> str:
        return "-" if x is None else format(scale * x, spec)

    for r in records:
        print(
            f"  {r['method']:<24} {cell(r['step_time_ms'], '.1f'):>9} {cell(r['warmup_step_time_ms'], '.1f'):>10} "
            f"{cell(r['bytes_per_step'], '.0f'):>12} {cell(r['warmup_bytes_per_step'], '.0f'):>13} "
            f"{r['final_loss']:>10.4f} {cell(r.get('time_to_target_s'), '.2f'):>12} "
            f"{cell(r['comm_hidden_fraction'], '.0f', 100):>7} {cell(r['warmup_comm_hidden_fraction'], '.0f', 100):>14}"
        )
    for line in ratios(by):
        print("# " + line)
    if args.json:
        write_json(records, args.json)
    if args.plot:
        plot(records, args.plot, label)


def ratios(by: dict[str, dict[str, Any]]) -> list[str]:
    """The comparisons the targets are stated in, each a ratio of two timings of this run."""
    lines = []
    base = by.get("ddp_adamw")
    if base is not None and "comm_fraction" in base:
        lines.append(
            f"ddp_adamw spends {100 * base['comm_fraction']:.0f}% of its step communicating "
            f"(alone, the step takes {base['compute_step_time_ms']:.1f} ms)"
        )
    for fast, slow in (
        ("onebit_adam", "ddp_adamw"),
        ("onebit_adam", "ddp_adamw_bf16"),
        ("onebit_lamb", "ddp_adamw"),
        ("zeroone_adam", "ddp_adamw"),
        ("ddp_sgd_onebit", "ddp_sgd"),
        ("ddp_sgd_onebit", "ddp_adamw_powersgd"),
        ("ddp_adamw_powersgd", "ddp_adamw"),
        ("ddp_adamw_bf16", "ddp_adamw"),
        ("fsdp_onebit_adam", "fsdp_adamw"),
        ("fsdp_onebit_sgd", "fsdp_adamw"),
        ("hsdp_onebit_adam", "hsdp_adamw"),
        ("hsdp_onebit_sgd", "hsdp_adamw"),
    ):
        if fast in by and slow in by and None not in (by[fast]["step_time_ms"], by[slow]["step_time_ms"]):
            lines.append(
                f"speedup of {fast} over {slow}: {by[slow]['step_time_ms'] / by[fast]['step_time_ms']:.2f}x "
                "(ratio of compression-stage step times)"
            )
    for name in ("onebit_adam", "onebit_lamb", "zeroone_adam"):
        r = by.get(name)
        if r is not None and base is not None and r["warmup_step_time_ms"]:
            lines.append(
                f"{name} warm-up step: {r['warmup_step_time_ms'] / base['step_time_ms']:.2f}x ddp_adamw's step"
            )
    for name in ("diloco", "diloco_exact", "diloco_rotate"):
        r = by.get(name)
        if r is None:
            continue
        if base is not None:
            lines.append(
                f"{name} mean step with its syncs (every {r['sync_every']} steps): {r['mean_step_time_ms']:.1f} ms, "
                f"{base['mean_step_time_ms'] / r['mean_step_time_ms']:.2f}x faster than ddp_adamw's mean step"
            )
        if "compute_step_time_ms" in r:
            compute = r["compute_step_time_ms"]
            beside = f" (ddp_adamw's: {base['mean_step_time_ms'] / compute:.2f}x)" if base is not None else ""
            lines.append(
                f"{name} mean step / the step with no communication: {r['mean_step_time_ms'] / compute:.2f}x{beside}"
            )
    if "ddp_sgd" in by and "ddp_sgd_onebit" in by:
        a, b = by["ddp_sgd"]["final_loss"], by["ddp_sgd_onebit"]["final_loss"]
        lines.append(f"onebit hook final loss {b:.4f} vs uncompressed DDP + SGD {a:.4f} ({100 * (b - a) / a:+.2f}%)")
    return lines


def plot(records: list[dict[str, Any]], path: str, label: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_bytes) = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for r in records:
        curve = running_mean(r["loss_curve"], max(1, r["steps"] // 20))
        steps = range(1, len(curve) + 1)
        style = "--" if "onebit" in r["method"] else "-"
        by_step.plot(steps, curve, style, label=f"{r['method']} (final {r['final_loss']:.3f})")
        by_bytes.plot([b / 2**20 for b in r["bytes_sent"]], curve, style, label=r["method"])
    by_step.set_xlabel("step")
    by_step.set_ylabel("training loss (mean over ranks, running mean)")
    by_bytes.set_xlabel("MiB sent per rank")
    by_bytes.set_xscale("log")
    for ax in (by_step, by_bytes):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"train_step: {label}, {records[0]['world_size']} ranks", fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(make_parent(path), dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# launch


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset of " + ", ".join(METHODS))
    p.add_argument("--steps", type=int, default=20, help="steps per method (default 20)")
    p.add_argument("--warmup-steps", type=int, default=5, help="warm-up stage length (default 5)")
    p.add_argument(
        "--compute-heavy",
        dest="setting",
        action="store_const",
        const="compute-heavy",
        default="comm-bound",
        help="a ~9x smaller model with 128x the batch: the compute-bound end",
    )
    p.add_argument("--context", type=int, help="characters of context (overrides the setting)")
    p.add_argument("--embed", type=int, help="embedding width (overrides the setting)")
    p.add_argument("--hidden", type=int, help="hidden width (overrides the setting)")
    p.add_argument("--batch", type=int, help="sequences per rank per step (overrides the setting)")
    p.add_argument("--lr-adam", type=float, default=1e-3, help="AdamW / 1-bit Adam / 0/1 Adam (default 1e-3)")
    p.add_argument("--lr-lamb", type=float, default=1e-2, help="1-bit LAMB (default 1e-2)")
    p.add_argument("--eps", type=float, default=1e-4, help="eps of every Adam/LAMB method (default 1e-4: see above)")
    p.add_argument("--lr-sgd", type=float, default=0.1, help="SGD with momentum 0.9 (default 0.1)")
    p.add_argument(
        "--backend",
        choices=("gloo", "mpi"),
        default="gloo",
        help="compcomm's collectives (the 1-bit hook, the optimizers, DiLoCo): gloo, or mpi under mpirun; "
        "torch's DDP and FSDP always run on the gloo group of the same ranks (default gloo)",
    )
    p.add_argument("--sync-every", type=int, default=8, help="DiLoCo's inner steps per sync, H (default 8)")
    p.add_argument("--diloco-fragments", type=int, default=1, help="DiLoCo's streaming fragments (default 1)")
    p.add_argument(
        "--hsdp-intra",
        choices=("shm", "fsdp"),
        default="shm",
        help="compcomm's HSDP methods: FSDP's collectives inside a host over shared memory, or FSDP's gloo group",
    )
    p.add_argument(
        "--bucket-mb",
        type=float,
        default=None,
        help="DDP's bucket_cap_mb and DiLoCo's bucket size (default 25; PowerSGD always runs in one bucket)",
    )
    p.add_argument("--text-bytes", type=int, default=1_000_000, help="characters of stdlib source to train on")
    add_nprocs_argument(p)
    p.add_argument(
        "--no-baseline", action="store_true", help="skip the no-communication step (timed with ddp_adamw or diloco)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", type=output_path, help="write one record per method")
    p.add_argument(
        "--plot", metavar="PATH", type=output_path, help="PNG of the loss against steps and against bytes sent"
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")
    args = p.parse_args(argv)
    unknown = set(args.methods.split(",")) - set(METHODS) - {""}
    if unknown:
        p.error(f"unknown methods {sorted(unknown)}; choose from {', '.join(METHODS)}")
    chosen = {m for m in args.methods.split(",") if m}
    if not chosen:
        p.error(f"--methods names no method; choose from {', '.join(METHODS)}")
    if args.steps < 1 or not 0 <= args.warmup_steps:
        p.error("--steps must be >= 1 and --warmup-steps >= 0")
    for flag in ("--lr-adam", "--lr-lamb", "--lr-sgd", "--eps"):
        value = getattr(args, flag[2:].replace("-", "_"))
        if not (math.isfinite(value) and value > 0):
            p.error(f"{flag} must be a positive number, got {value:g}")
    for flag in ("--context", "--embed", "--hidden", "--batch"):
        value = getattr(args, flag[2:])
        if value is not None and value < 1:
            p.error(f"{flag} must be >= 1, got {value}")
    frozen = sorted(chosen & FROZEN_AFTER_WARMUP)
    if args.warmup_steps < 1 and frozen:
        p.error(f"{', '.join(frozen)} freeze their variance after a warm-up of at least one step: --warmup-steps >= 1")
    if args.warmup_steps < 2 and "ddp_adamw_powersgd" in chosen:
        p.error("PowerSGD compresses from step 2 at the earliest (start_powerSGD_iter >= 2): --warmup-steps >= 2")
    if any(m.startswith("diloco") for m in chosen) and (args.sync_every < 1 or args.diloco_fragments < 1):
        p.error("--sync-every and --diloco-fragments must be >= 1")
    why = mpirun_needed(args.nprocs) if args.backend == "mpi" else None
    if why:
        p.error(why)
    hsdp = sorted(m for m in chosen if m.startswith("hsdp"))
    if hsdp and args.methods != ",".join(METHODS) and (launched_world() or args.nprocs) < 2:
        p.error(f"{', '.join(hsdp)} need at least 2 ranks (replicas across hosts); this run has 1")
    defaults = SETTINGS[args.setting]
    args.shape = tuple(
        v if v is not None else d for v, d in zip((args.context, args.embed, args.hidden, args.batch), defaults)
    )
    if args.text_bytes < args.shape[0] + 2:
        p.error(f"--text-bytes must be at least the context + 2 ({args.shape[0] + 2}), got {args.text_bytes}")
    if args.bucket_mb is not None and not (math.isfinite(args.bucket_mb) and args.bucket_mb > 0):
        p.error(f"--bucket-mb must be a positive number, got {args.bucket_mb:g}")
    if any(m.startswith("diloco") for m in chosen):
        why = diloco_schedule_problem(args)
        if why:
            p.error(why)
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            p.error("--plot needs matplotlib (pip install matplotlib)")
    return args


def diloco_schedule_problem(args: argparse.Namespace) -> str | None:
    """Why the DiLoCo methods cannot run as asked, found before any rank starts (they come late
    in the list, after the other methods have trained): more fragments than sync steps or than
    the model makes buckets (a bucket holds whole parameters), or no sync in the timed steps
    (its step time "with its syncs" would have none)."""
    from compcomm.layout import bucket_groups

    h, fragments, w = args.sync_every, args.diloco_fragments, args.warmup_steps
    if fragments > h:
        return f"--diloco-fragments {fragments} must be at most --sync-every {h} (one fragment's sync per step)"
    with torch.device("meta"):  # the parameters' sizes, without their memory
        trained = [p for p in make_model(args).parameters() if p.requires_grad]
    buckets = len(trained) if args.bucket_mb is None else len(bucket_groups(trained, bucket_bytes(args), torch.float32))
    if fragments > buckets:
        return f"--diloco-fragments {fragments} needs as many buckets, and this model's parameters make {buckets}"
    if args.steps // h * h <= w:
        return (
            f"DiLoCo syncs every {h} steps: --steps {args.steps} after {w} warm-up steps times no sync; "
            f"take --steps >= {(w // h + 1) * h} or a smaller --sync-every"
        )
    return None


def bucket_bytes(args: argparse.Namespace) -> int | None:
    """--bucket-mb in bytes (None: each method's own default)."""
    return None if args.bucket_mb is None else int(args.bucket_mb * 2**20)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    run_ranks(functools.partial(rank_main, label=launch_label(args.nprocs)), args, args.nprocs)
    return 0


if __name__ == "__main__":
    sys.exit(main())

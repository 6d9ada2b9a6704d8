#!/usr/bin/env python3
"""What compcomm.fsdp's error state costs in memory, next to what sharding saves.

    python bench/fsdp_memory.py                        # 4 local ranks
    python bench/fsdp_memory.py --json out.json

FSDP2 shards parameters, gradients and optimizer state n-fold. compcomm's FSDP mode keeps on
every rank a worker error the size of each module's whole (unsharded) gradient, fp32: error
feedback on the sending side of a reduce-scatter needs what this rank sent, all of it. HSDP's
error is the size of the shard. With nonfinite="propagate" each has a spare of the same size.

For the same model (bench/train_step.py's 11M-parameter character MLP) trained a few steps past
the switch to 1 bit, every rank reports the bytes it holds in: parameters (its shards),
gradients, optimizer state (OnebitAdam's moments), compcomm's error state, and what the same
training would hold unsharded (DDP-like: whole parameters, gradients and Adam moments). Counted
from the tensors themselves (untyped storage sizes), so that the figures are exact.

Then the transient memory of one call of the mode's collective on a 16 MiB fp32 input (FSDP: the
1-bit reduce-scatter over all ranks; HSDP: the 1-bit allreduce of a shard across the replicas),
with its error feedback already in use: the most the call held at once beyond what existed before
it, as a multiple of the input's size (the peak resident set; the ranks start with glibc's mmap
threshold lowered so that freed buffers leave the process, bench/peak_memory.py).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
from sharding import host_groups, shard_children

from peak_memory import PeakMemory, mmap_threshold_env
from peak_memory import supported as memory_measurable
from ranks import add_nprocs_argument, run_ranks
from records import output_path, write_json
from tasks import CharMLP

MODES = ("fsdp", "fsdp_propagate", "hsdp")
TRANSIENT_NUMEL = 4 << 20  # 16 MiB of fp32


def tensor_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (a view counts its storage once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        local = t.to_local() if hasattr(t, "to_local") else t
        storage = local.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def measure(mode: str, args: argparse.Namespace) -> dict:
    """One mode on this rank: train past the switch, then count."""
    from torch.distributed.device_mesh import DeviceMesh

    import compcomm
    import compcomm.optim

    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    model = CharMLP(32, 32, 2816)
    replicas = None
    if mode == "hsdp":
        shard, replicas = host_groups(world // 2)
        mesh = DeviceMesh.from_group(shard, "cpu")
    else:
        mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    shard_children(model, mesh)
    nonfinite = "propagate" if mode == "fsdp_propagate" else "raise"
    state = compcomm.fsdp.compress(model, start_iter=2, replicate_group=replicas, nonfinite=nonfinite)
    opt = compcomm.optim.OnebitAdam(model.parameters(), lr=1e-3, freeze_step=2)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(args.steps):
        seq = torch.randint(0, 96, (8, 33), generator=gen)
        torch.nn.functional.cross_entropy(model(seq[:, :-1]), seq[:, -1]).backward()
        opt.step()
    params = list(model.parameters())
    whole = sum(p.numel() for p in params) * 4
    held = list(state.error_feedback.values()) + [m.spare for m in state._modules.values() if m.spare is not None]
    moments = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    transient = transient_peak(replicas)
    return {
        "mode": mode,
        "world_size": world,
        "rank": rank,
        "params_bytes": tensor_bytes(params),
        "grads_bytes": tensor_bytes([p.grad for p in params]),
        "optimizer_bytes": tensor_bytes(moments),
        "error_bytes": sum(ef.nbytes for ef in held),
        "unsharded_bytes": 4 * whole,  # parameters, gradients, Adam's two moments, all whole
        "transient_input_bytes": 4 * TRANSIENT_NUMEL,
        "transient_peak_bytes": transient,
    }


def transient_peak(replicas: dist.ProcessGroup | None) -> int | None:
    """The largest transient peak (max over ranks) of three calls of the mode's 1-bit collective
    on a 16 MiB input, after two unmeasured calls (an allreduce in place allocates its second
    worker buffer, persistent state counted with the errors, at the second); None where it
    cannot be measured."""
    import compcomm

    group = dist.group.WORLD if replicas is None else replicas
    be = compcomm.backends.get("gloo", group=group)
    n = be.world_size
    x = torch.randn(TRANSIENT_NUMEL, generator=torch.Generator().manual_seed(be.rank))
    out = torch.empty(TRANSIENT_NUMEL // n)
    ef = compcomm.ErrorFeedback()

    def call() -> None:
        if replicas is None:
            compcomm.compressed_reduce_scatter(out, x, ef, backend=be)
        else:
            compcomm.compressed_allreduce(x, ef, backend=be)

    call()
    call()
    peaks = []
    for _ in range(3):
        with PeakMemory(torch.device("cpu")) as probe:
            call()
        peaks.append(probe.bytes or 0)
    mine = torch.tensor([max(peaks)], dtype=torch.float64)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    return int(mine.item()) if memory_measurable(torch.device("cpu")) else None


def rank_main(args: argparse.Namespace) -> list[dict]:
    torch.set_num_threads(1)
    return [measure(mode, args) for mode in args.modes.split(",")]


def transient_ratio(record: dict) -> str:
    peak = record["transient_peak_bytes"]
    return "n/a" if peak is None else f"{peak / record['transient_input_bytes']:.3f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_nprocs_argument(ap)
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {', '.join(MODES)}")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--json", metavar="PATH", type=output_path)
    args = ap.parse_args(argv)
    results, world = run_ranks(rank_main, args, args.nprocs)
    if results is None:
        return 0
    print(f"# compcomm fsdp_memory: {world} ranks, CharMLP 11.2M parameters, OnebitAdam, bytes per rank (rank 0)")
    print(
        f"# {'mode':<16} {'params':>12} {'grads':>12} {'optimizer':>12} {'compcomm error':>15} "
        f"{'sharded total':>14} {'unsharded':>12} {'error/unsharded':>15} {'call transient(x)':>17}"
    )
    for r in results:
        total = r["params_bytes"] + r["grads_bytes"] + r["optimizer_bytes"] + r["error_bytes"]
        print(
            f"  {r['mode']:<16} {r['params_bytes']:>12,d} {r['grads_bytes']:>12,d} {r['optimizer_bytes']:>12,d} "
            f"{r['error_bytes']:>15,d} {total:>14,d} {r['unsharded_bytes']:>12,d} "
            f"{r['error_bytes'] / r['unsharded_bytes']:>15.2f} {transient_ratio(r):>17}"
        )
    if args.json:
        write_json(results, args.json)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.update(mmap_threshold_env())  # read by glibc when each rank's process starts
    sys.exit(main())

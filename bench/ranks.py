"""Starting a benchmark's ranks, and collecting what each rank measured.

SPEC 7 lets every benchmark run three ways: under torchrun (or inside bench/netsim.py, which
sets torchrun's environment), under mpirun (bench/allreduce_bw.py --backend mpi), or plainly as
`python bench/<prog>.py`, which spawns local gloo ranks itself through `compcomm.launch`. The
gloo cases are the same code once the process group exists, so a benchmark writes one
function of its parsed arguments that runs on every rank and hands it to `run_ranks`.
"""

from __future__ import annotations

import argparse
import datetime
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from compcomm import launch

if TYPE_CHECKING:
    from compcomm.backends import Backend

T = TypeVar("T")
TIMEOUT = datetime.timedelta(minutes=10)
"""How long a collective may wait for a peer: long enough for a slow rank's step on an
oversubscribed machine, short enough that a dead peer ends the run."""


def add_nprocs_argument(parser: argparse.ArgumentParser, flag: str = "--nprocs") -> None:
    """The option giving the number of local ranks to spawn when the program was not launched."""
    parser.add_argument(
        flag,
        type=int,
        default=4,
        help="local ranks to spawn when not started by torchrun, bench/netsim.py or mpirun (default 4)",
    )


def set_threads(world: int | None = None) -> None:
    """torch's threads in this rank: OMP_NUM_THREADS when it is set (bench/netsim.py sets it),
    else, given the `world` of ranks sharing this machine, an even share of its cores, else
    torch's default. Ranks that each take every core slow each other down."""
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))
    elif world is not None:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))


def launch_label(world: int) -> str:
    """How the ranks were started, for a report's header: "netsim 1gbit +0.1ms", "torchrun",
    "mpirun" or "4 local ranks (self-spawned)". Call it before spawning."""
    rate = os.environ.get("NETSIM_RATE")
    if rate:
        delay = os.environ.get("NETSIM_DELAY")
        return f"netsim {rate}" + (f" +{delay}" if delay else "")
    how = launch.launcher()
    return how if how is not None else f"{world} local ranks (self-spawned)"


def run_ranks(
    rank_fn: Callable[[argparse.Namespace], T],
    args: argparse.Namespace,
    world: int,
    timeout: datetime.timedelta = TIMEOUT,
) -> tuple[T | None, int]:
    """Run `rank_fn(args)` on every rank of a gloo group: here, when this process is one rank of
    a torchrun-style launch, else on `world` local ranks spawned for it (`rank_fn` and `args`
    must then pickle: a module-level function, or a functools.partial of one). Returns rank 0's
    result (None on the other ranks) and the world size."""
    if launch.launcher() == "torchrun":
        result = _joined(rank_fn, args, timeout)
        return result, int(os.environ["WORLD_SIZE"])
    return launch.spawn(_joined, world, rank_fn, args, timeout)[0], world


def _joined(
    rank_fn: Callable[[argparse.Namespace], T], args: argparse.Namespace, timeout: datetime.timedelta
) -> T | None:
    """One rank: join the group, run, leave; rank 0's result, None elsewhere."""
    dist.init_process_group("gloo", timeout=timeout)
    try:
        result = rank_fn(args)
        return result if dist.get_rank() == 0 else None
    finally:
        dist.destroy_process_group()


def gather_floats(backend: Backend, values: float | Sequence[float]) -> np.ndarray:
    """Every rank's `values` (a float, or a list of k floats), as an (n,) or (n, k) array on every
    rank, through the backend's own all_gather: it works on every backend, mpi included, where
    torch.distributed may not be initialized."""
    mine = np.atleast_1d(np.asarray(values, dtype=np.float64))
    send = torch.from_numpy(mine.view(np.uint8).copy()).to(backend.device)
    recv = torch.empty(backend.world_size, send.numel(), dtype=torch.uint8, device=backend.device)
    backend.all_gather(send, recv)
    out = recv.cpu().numpy().copy().view(np.float64).reshape(backend.world_size, -1)
    return out.reshape(-1) if np.ndim(values) == 0 else out

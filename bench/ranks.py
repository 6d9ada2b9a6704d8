"""Starting a benchmark's ranks, and collecting what each rank measured.

Every benchmark runs three ways: under torchrun (or inside bench/netsim.py, which
sets torchrun's environment), under mpirun, or plainly as `python bench/<prog>.py`, which spawns
local gloo ranks itself through `compcomm.launch`. Under mpirun the ranks mpirun started form the
gloo group (`launched_world` gives them torchrun's variables from MPI's world), so the three are
the same code once the process group exists: a benchmark writes one function of its parsed
arguments that runs on every rank and hands it to `run_ranks`.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
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
    """The option giving the number of local ranks to spawn when the program was not launched;
    fewer than one is a usage error, before anything starts."""

    def count(text: str) -> int:
        ranks = int(text)
        if ranks < 1:
            raise argparse.ArgumentTypeError(f"{flag} must be at least 1, got {ranks}")
        return ranks

    parser.add_argument(
        flag,
        type=count,
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


def mpirun_needed(nprocs: int) -> str | None:
    """None under mpirun; elsewhere, what to tell a user who asked for --backend mpi: the mpirun
    command that runs this very command line on `nprocs` local ranks (as many as torchrun
    started, under torchrun), or how to get an mpirun."""
    how = launch.launcher()
    if how == "torchrun":
        nprocs = int(os.environ["WORLD_SIZE"])
    if how == "mpirun":
        return None
    try:
        command = " ".join([*launch.mpirun(nprocs), *sys.argv])
    except RuntimeError as exc:  # no mpirun here: say how to get one
        return f"--backend mpi runs under mpirun (an MPI launcher): {exc}"
    return f"--backend mpi runs under mpirun (an MPI launcher), e.g.:\n  {command}"


def launched_world() -> int | None:
    """The world size when this process is one rank of a launch, None for a plain run (whose
    ranks the benchmark spawns). Under mpirun, the first call gives this process torchrun's
    variables from MPI's world (`_torchrun_variables_from_mpi`), so that
    `init_process_group("gloo")` joins the ranks mpirun started instead of each spawning its own."""
    how = launch.launcher()
    if how is None:
        return None
    if how == "mpirun" and "RANK" not in os.environ:
        _torchrun_variables_from_mpi()
    return int(os.environ["WORLD_SIZE"])


def _torchrun_variables_from_mpi() -> None:
    """RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE (the ranks sharing this node's memory),
    MASTER_ADDR and MASTER_PORT from MPI's COMM_WORLD: rank 0 picks a free port on MASTER_ADDR
    (when set), else on loopback when the whole world is on its node, else on its host name's
    address, and broadcasts both."""
    import socket

    from compcomm.backends.mpi_runtime import import_mpi

    mpi = import_mpi()
    world = mpi.COMM_WORLD
    node = world.Split_type(mpi.COMM_TYPE_SHARED)
    try:
        where = None
        if world.rank == 0:
            addr = os.environ.get("MASTER_ADDR") or (
                launch.HOST if node.size == world.size else socket.gethostbyname(socket.gethostname())
            )
            where = (addr, launch.free_port(addr))
        addr, port = world.bcast(where, root=0)
        os.environ.update(
            RANK=str(world.rank),
            WORLD_SIZE=str(world.size),
            LOCAL_RANK=str(node.rank),
            LOCAL_WORLD_SIZE=str(node.size),
            MASTER_ADDR=addr,
            MASTER_PORT=str(port),
        )
    finally:
        node.Free()


def run_ranks(
    rank_fn: Callable[[argparse.Namespace], T],
    args: argparse.Namespace,
    world: int,
    timeout: datetime.timedelta = TIMEOUT,
) -> tuple[T | None, int]:
    """Run `rank_fn(args)` on every rank of a gloo group: here, when this process is one rank of
    a launch (torchrun, bench/netsim.py or mpirun), else on `world` local ranks spawned for it
    (`rank_fn` and `args` must then pickle: a module-level function, or a functools.partial of
    one). Returns rank 0's result (None on the other ranks) and the world size."""
    launched = launched_world()
    if launched is not None:
        return _joined(rank_fn, args, timeout), launched
    return launch.spawn(_joined, world, rank_fn, args, timeout)[0], world


def _joined(
    rank_fn: Callable[[argparse.Namespace], T], args: argparse.Namespace, timeout: datetime.timedelta
) -> T | None:
    """One rank: join the group, run, leave; rank 0's result, None elsewhere."""
    with launch.process_group("gloo", timeout=timeout):
        result = rank_fn(args)
        return result if dist.get_rank() == 0 else None


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

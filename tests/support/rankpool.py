"""Real ranks for tests: processes joined by gloo on loopback, kept for a whole module.

The processes are forked from multiprocessing's fork server, which imports torch, numpy and
compcomm once for the whole session: a module's ranks then start in a fraction of a second,
where spawning them (a fresh interpreter importing torch each) took about 4 s of the suite's two
cores per module. It imports torch._dynamo too, which torch's Optimizer imports when a process
builds its first optimizer: about 1.8 s of a core per rank otherwise. They are plain processes
all the same: their own memory, their own gloo. Their environment is the fork server's, taken
when the session's first pool started (after conftest's): a variable a test sets later in this
process does not reach them.

`RankPool.run(fn, *args, ranks=...)` calls a picklable module-level `fn(*args)` on the chosen
ranks at once and returns their results in rank order; a rank that raises fails the test with
its traceback, and a rank that does not answer within the timeout fails it instead of hanging.
Inside a rank, `group(k)` is the sub-group of ranks 0..k-1 and `group((1, 3))` that of the
listed ranks, all created once at start-up.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import traceback
from collections.abc import Callable, Iterable
from typing import Any

from compcomm.launch import free_port, rank_environment

PRELOADED = ["torch", "torch.distributed", "torch._dynamo", "numpy", "compcomm"]
SUBGROUPS = [(0,), (1,), (2,), (3,), (0, 1), (0, 1, 2), (0, 1, 2, 3), (1, 3), (0, 2), (2, 3)]
_groups: dict[tuple[int, ...], Any] = {}


def group(members: int | tuple[int, ...]):
    """The torch.distributed group of ranks 0..members-1 (int) or of the given ranks (tuple)."""
    return _groups[tuple(range(members)) if isinstance(members, int) else tuple(members)]


def _serve(rank: int, world_size: int, port: int, conn) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(rank_environment(rank, world_size, port))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    for members in SUBGROUPS:
        if max(members) < world_size:
            _groups[members] = dist.new_group(list(members))
    conn.send(("ready", None))
    while True:
        message = conn.recv()
        if message is None:
            break
        fn, args = message
        try:
            conn.send(("ok", fn(*args)))
        except BaseException:
            conn.send(("error", traceback.format_exc()))
    dist.destroy_process_group()


class RankPool:
    def __init__(self, world_size: int = 4, timeout: float = 120.0) -> None:
        self.world_size, self.timeout = world_size, timeout
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOADED)  # read once, when the server starts
        port = free_port()
        self._conns, self._procs = [], []
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(rank, world_size, port, child), daemon=True)
            proc.start()
            self._conns.append(parent)
            self._procs.append(proc)
        self._collect(range(world_size))

    def run(self, fn: Callable, *args, ranks: Iterable[int] | None = None) -> list:
        ranks = list(range(self.world_size) if ranks is None else ranks)
        for r in ranks:
            self._conns[r].send((fn, args))
        return self._collect(ranks)

    def _collect(self, ranks: Iterable[int]) -> list:
        results, errors = [], []
        for r in ranks:
            if not self._conns[r].poll(self.timeout):
                self.close()
                raise TimeoutError(f"rank {r} did not answer within {self.timeout}s (hang?)")
            status, value = self._conns[r].recv()
            if status == "error":
                errors.append(f"rank {r}:\n{value}")
            results.append(value)
        if errors:
            raise RuntimeError("\n".join(errors))
        return results

    def close(self) -> None:
        for conn, proc in zip(self._conns, self._procs):
            try:
                if proc.is_alive():
                    conn.send(None)
            except OSError:
                pass
        for proc in self._procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
        self._procs = []


def caught(fn: Callable, *args, **kwargs) -> tuple[str, str] | None:
    """Run fn; return (exception class name, message) if it raised, else None."""
    try:
        fn(*args, **kwargs)
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return None


def reports_of_dying_ranks(target: Callable, world_size: int, count: int, timeout: float = 120.0) -> tuple[list, list]:
    """Start `target(rank, port, queue)` on `world_size` fresh processes, some of which die on
    purpose (so neither the pool nor `compcomm.launch.spawn`, which fail on a dead rank, serve),
    and collect the first `count` reports they put on the queue. Returns the reports and the
    processes' pids; what still runs afterwards is killed."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, port, results), daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    try:
        reports = [results.get(timeout=timeout) for _ in range(count)]
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    return reports, [p.pid for p in procs]

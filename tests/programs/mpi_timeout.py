"""A peer that stops answering, under `mpirun -n 3 python tests/programs/mpi_timeout.py OUT_DIR`.

Every rank builds three mpi backends (timeout 2 s, one given as a timedelta) on duplicates of
COMM_WORLD; then rank 2 freezes (sleeps, never calling) while ranks 0 and 1 run a compressed
allreduce, an uncompressed all_reduce and a barrier, one per backend. Each must raise
RuntimeError once the timeout has passed, not hang, and a backend that timed out refuses the
next call at once.

Then two backends over one more communicator, timeouts 4 s and 2 s: an async call of the first
is in flight when the second's call is made, which queues behind it. The first call raises after
its 4 s and breaks the communicator's channel, so the queued call raises then too, not after its
own 2 s on top; a third backend made over the same communicator afterwards refuses at once. Each
rank writes OUT_DIR/rank<r>.json; the frozen rank stays frozen until the others have written
theirs (at most 16 s).
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time

import torch

import compcomm
from compcomm.backends.mpi import MPIBackend
from compcomm.backends.mpi_runtime import import_mpi

TIMEOUT_S = 2.0
FROZEN_RANK = 2


def timed(fn) -> dict:
    """How fn ended: the exception class and message, and the seconds it took."""
    start = time.monotonic()
    try:
        fn()
        raised, message = None, ""
    except Exception as exc:  # noqa: BLE001 - the class is what the test checks
        raised, message = type(exc).__name__, str(exc)
    return {"raised": raised, "message": message, "seconds": time.monotonic() - start}


def main(out_dir: str) -> int:
    MPI = import_mpi()
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    timeouts = [TIMEOUT_S, datetime.timedelta(seconds=TIMEOUT_S), TIMEOUT_S]
    backends = [MPIBackend(comm=world.Dup(), timeout=t, device="cpu") for t in timeouts]
    shared = world.Dup()
    slow, quick = (MPIBackend(comm=shared, timeout=t, device="cpu") for t in (2 * TIMEOUT_S, TIMEOUT_S))
    slow.barrier()  # opens the communicator's private duplicate (a collective) while every rank answers
    world.Barrier()
    result: dict = {"rank": rank}
    if rank == FROZEN_RANK:  # frozen to MPI (the others' collectives never complete) until they are done
        others = [os.path.join(out_dir, f"rank{r}.json") for r in range(world.Get_size()) if r != rank]
        deadline = time.monotonic() + 8 * TIMEOUT_S
        while not all(os.path.exists(path) for path in others) and time.monotonic() < deadline:
            time.sleep(0.1)
        result["frozen"] = True
    else:
        compressed, plain, barrier = backends
        t = torch.randn(1000)
        result["compressed"] = timed(
            lambda: compcomm.compressed_allreduce(t, compcomm.ErrorFeedback(), backend=compressed)
        )
        result["all_reduce"] = timed(lambda: plain.all_reduce(torch.ones(100)))
        result["barrier"] = timed(barrier.barrier)
        result["after"] = timed(lambda: compressed.all_reduce(torch.ones(100)))
        start = time.monotonic()
        in_flight = slow.all_reduce(torch.ones(100), async_op=True)
        result["queued"] = timed(lambda: quick.all_reduce(torch.ones(100)))
        result["in_flight"] = timed(in_flight.wait)
        result["in_flight"]["seconds"] = time.monotonic() - start
        result["fresh"] = timed(lambda: MPIBackend(comm=shared, device="cpu").all_reduce(torch.ones(100)))
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))

"""A peer that arrives after the others timed out, under `mpirun -n 3 python tests/programs/mpi_late_peer.py OUT_DIR`.

After one call together, ranks 0 and 1 run a second compressed allreduce of 100,000 elements
on an mpi backend with a 1 s timeout (its phase 0 carries early rows, sized by the first call);
rank 2 joins it 3 s late. MPI cannot call a collective off,
so the late rank completes it on the others' side too, writing into the memory of the timed-out
calls. Meanwhile ranks 0 and 1 free everything they can and fill new tensors ("canaries"), then
let MPI progress with barriers of their own on COMM_WORLD. Each rank writes OUT_DIR/rank<r>.json:
whether every canary still holds its value (and that it got there: freed memory written by MPI
corrupted the heap or crashed the rank).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time

import torch

import compcomm
from compcomm.backends.mpi_runtime import import_mpi

TIMEOUT_S = 1.0
LATE_RANK = 2
NUMEL = 100_000


def main(out_dir: str) -> None:
    MPI = import_mpi()
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    torch.set_num_threads(1)
    backend = compcomm.backends.get("mpi", timeout=TIMEOUT_S)
    errors = compcomm.ErrorFeedback()
    compcomm.compressed_allreduce(torch.randn(NUMEL), errors, backend=backend)  # its rows size the next call's phase 0
    if rank == LATE_RANK:
        time.sleep(3 * TIMEOUT_S)
    try:
        compcomm.compressed_allreduce(torch.randn(NUMEL), errors, backend=backend)
        raised = None
    except RuntimeError as exc:
        raised = type(exc).__name__
    gc.collect()
    canaries = [torch.full((k,), 7.0) for k in (NUMEL, NUMEL // 8, NUMEL // 32, 64, 1024) for _ in range(40)]
    canaries += [torch.full((k,), 7, dtype=torch.uint8) for k in (NUMEL // 8, NUMEL // 32, 256) for _ in range(40)]
    for _ in range(3):  # the late rank's calls complete on every rank as MPI progresses
        time.sleep(TIMEOUT_S)
        world.Barrier()
    intact = all(bool((c == 7).all()) for c in canaries)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "raised": raised, "canaries_intact": intact}, f)


if __name__ == "__main__":
    main(sys.argv[1])

"""The DDP hook over the mpi backend, run under `mpirun -n 4 python tests/programs/ddp_mpi_checks.py OUT_DIR`.

DDP itself needs a torch process group: every rank joins a gloo group (rank and size from MPI,
the port chosen by rank 0 and broadcast over MPI). The same training, compressed from its first
iteration, then runs twice, with the hook's collectives on backend="mpi" and on gloo (the 1-bit
algorithm is bitwise the same on every transport); each rank writes OUT_DIR/rank<r>.json.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import sys
import traceback

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

TESTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir)
sys.path[:0] = [TESTS, os.path.join(TESTS, "support")]

from test_ddp_hook import BUCKET_MB, make_net, sgd, train  # noqa: E402

import compcomm  # noqa: E402
from compcomm.backends.mpi_runtime import import_mpi  # noqa: E402
from compcomm.ddp import OnebitHookState, onebit_hook  # noqa: E402
from compcomm.launch import free_port  # noqa: E402

MPI = import_mpi()
RANK, SIZE = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()


def join_gloo() -> None:
    port = MPI.COMM_WORLD.bcast(free_port() if RANK == 0 else None, root=0)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=RANK,
        world_size=SIZE,
        timeout=datetime.timedelta(seconds=60),
    )


def run(backend) -> tuple[str, int]:
    ddp = DDP(make_net(), bucket_cap_mb=BUCKET_MB)
    state = OnebitHookState(start_iter=0, backend=backend)  # MPI's own sum order is not gloo's
    ddp.register_comm_hook(state, onebit_hook)
    params = train(ddp, sgd(ddp), range(6), RANK)
    return hashlib.sha256(b"".join(params)).hexdigest(), len(state.error_feedback)


def main(out: str) -> None:
    torch.set_num_threads(1)
    join_gloo()
    result: dict = {"rank": RANK}
    try:
        mpi = compcomm.backends.get("mpi")
        result["mpi"], result["buckets"] = run(mpi)
        result["gloo"], _ = run(compcomm.backends.get("gloo"))
        result["mpi_bytes"] = mpi.bytes_sent
        result["ok"] = True
    except Exception:
        result.update(ok=False, detail=traceback.format_exc())
    with open(os.path.join(out, f"rank{RANK}.json"), "w") as f:
        json.dump({"hook": result}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])

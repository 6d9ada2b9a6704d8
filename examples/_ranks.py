"""How every example starts: one function run on every rank of a gloo group.

Under torchrun (or any launcher that sets RANK and WORLD_SIZE) this process is one rank: it
joins the group and runs. Started plainly (`python examples/<name>.py`) it spawns 4 local ranks
with torchrun's environment through `compcomm.launch.spawn`, each of which does the same.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from compcomm import launch

LOCAL_RANKS = 4


def run(main: Callable[..., Any], *args: Any) -> None:
    """`main(*args)` on every rank (a module-level function: spawned ranks unpickle it)."""
    if launch.launcher() == "torchrun":
        _rank(main, *args)
    else:
        launch.spawn(_rank, LOCAL_RANKS, main, *args)


def _rank(main: Callable[..., Any], *args: Any) -> None:
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    with launch.process_group("gloo"):  # on GPUs: "nccl", with torch.cuda.set_device(LOCAL_RANK)
        main(*args)


def same_on_every_rank(tensors: list[torch.Tensor]) -> bool:
    """Whether every rank holds bitwise the same tensors (a collective)."""
    mine = torch.cat([t.detach().reshape(-1).float() for t in tensors])
    theirs = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(theirs, mine)
    return all(torch.equal(mine, other) for other in theirs)


@contextlib.contextmanager
def checkpoint_dir() -> Iterator[Path]:
    """A fresh directory for an example's checkpoint files, removed at the end (tempfile's: two
    runs never write the same files). Every rank gets rank 0's directory, made on its own node too
    where the nodes share no temporary directory; a file that one rank saves and another loads
    needs one they share (TMPDIR). Every rank enters and leaves it together."""
    made = [tempfile.mkdtemp(prefix="compcomm-example-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(made)
    path = Path(made[0])
    path.mkdir(exist_ok=True)
    try:
        yield path
        dist.barrier()  # every rank is done with the files
    finally:
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:  # one rank per node
            shutil.rmtree(path, ignore_errors=True)


def say(text: str) -> None:
    """Print on rank 0 only."""
    if dist.get_rank() == 0:
        print(text, flush=True)

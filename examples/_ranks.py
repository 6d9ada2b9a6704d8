"""How every example starts: one function run on every rank of a gloo group.

Under torchrun (or any launcher that sets RANK and WORLD_SIZE) this process is one rank: it
joins the group and runs. Started plainly (`python examples/<name>.py`) it spawns 4 local ranks
with torchrun's environment through `compcomm.launch.spawn`, each of which does the same.
"""

from __future__ import annotations

import os
from collections.abc import Callable
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


def say(text: str) -> None:
    """Print on rank 0 only."""
    if dist.get_rank() == 0:
        print(text, flush=True)

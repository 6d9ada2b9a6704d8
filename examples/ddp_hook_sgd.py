"""DDP with your own momentum SGD, its gradient buckets averaged in 1 bit by compcomm's comm hook.

    python examples/ddp_hook_sgd.py                         # 4 local ranks (gloo, CPU), spawned here
    torchrun --nproc-per-node 4 examples/ddp_hook_sgd.py    # the same under torchrun
    # 2 nodes x 4 ranks: run on every node (HOST0: the first node's address)
    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HOST0:29500 examples/ddp_hook_sgd.py

The first `start_iter` iterations average exactly, as DDP does; after them every bucket goes
through the 1-bit allreduce with its own error feedback, overlapping backward. Use it with SGD
(momentum or not): its update is linear in the averaged gradients, so error feedback keeps it
on track. For Adam or LAMB use compcomm.optim instead (examples/onebit_adam.py). Checkpoint:
the hook's state per rank (or `state.gathered_state_dict()` for one file) beside the model's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import compcomm

from _ranks import checkpoint_dir, run, same_on_every_rank, say


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(64, 32, generator=g)
    return x, x[:, :8].sum(dim=1, keepdim=True)


def main() -> None:
    rank = dist.get_rank()
    torch.manual_seed(0)  # DDP broadcasts rank 0's parameters anyway
    model = DDP(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1)))
    state = compcomm.ddp.OnebitHookState(start_iter=5)  # process_group=None: DDP's default group
    model.register_comm_hook(state, compcomm.ddp.onebit_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(20):
        x, y = batch(rank, step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()  # buckets are reduced in 1 bit from iteration 5 on, during backward
        opt.step()
        if step in (0, 19):
            say(f"step {step:2d}: loss {loss.item():.4f}")
    assert same_on_every_rank(list(model.parameters()))

    with checkpoint_dir() as ckpt:  # a fresh directory, removed afterwards
        torch.save(state.state_dict(), ckpt / f"hook_rank{rank}.pt")  # the hook's error feedback: per rank
        if rank == 0:
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict()}, ckpt / "model.pt")
        dist.barrier()
        resumed = compcomm.ddp.OnebitHookState(start_iter=5)
        resumed.load_state_dict(torch.load(ckpt / f"hook_rank{rank}.pt"))  # collective: every rank loads its own
    say("ddp_hook_sgd: OK (parameters equal on every rank, hook state saved and loaded)")


if __name__ == "__main__":
    run(main)

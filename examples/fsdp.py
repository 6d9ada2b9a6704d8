"""FSDP2 (`fully_shard`) with its gradient reduce-scatter in 1 bit, and 1-bit Adam on the shards.

    python examples/fsdp.py                                 # 4 local ranks (gloo, CPU), spawned here
    torchrun --nproc-per-node 4 examples/fsdp.py            # the same under torchrun
    # 2 nodes x 4 ranks: run on every node (HOST0: the first node's address)
    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HOST0:29500 examples/fsdp.py

`compcomm.fsdp.compress(model, start_iter=N)` replaces each FSDP module's gradient
reduce-scatter through FSDP2's own seam: exact for N iterations, then 1 bit per element with
error feedback. OnebitAdam given the sharded (DTensor) parameters sends nothing itself: it keeps
its state on the shards and freezes the variance at `freeze_step`, which must equal N. FSDP's
parameter all-gathers stay fp32. Checkpoint the compression state and the optimizer like
examples/onebit_adam.py does (`state_dict()` per rank, or `gathered_state_dict()`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import compcomm
from compcomm.optim import OnebitAdam

from _ranks import checkpoint_dir, run, same_on_every_rank, say

WARMUP = 3


def main() -> None:
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))  # "cuda" on GPUs
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    state = compcomm.fsdp.compress(model, start_iter=WARMUP)  # before the first backward, on every rank
    opt = OnebitAdam(model.parameters(), lr=1e-2, freeze_step=WARMUP)
    for step in range(8):
        x = torch.randn(64, 32, generator=torch.Generator().manual_seed(1000 * step + rank))
        loss = torch.nn.functional.mse_loss(model(x), x[:, :8].sum(dim=1, keepdim=True))
        opt.zero_grad()
        loss.backward()  # FSDP reduce-scatters each module's gradients through compcomm
        opt.step()
        if step in (0, 7):
            say(f"step {step}: loss {loss.item():.4f}, 1-bit: {state.compressing}")
    assert same_on_every_rank([p.full_tensor() for p in model.parameters()])
    with checkpoint_dir() as ckpt:  # a fresh directory, removed afterwards
        torch.save({"compression": state.state_dict(), "opt": opt.state_dict()}, ckpt / f"fsdp_rank{rank}.pt")
    say(f"fsdp: OK (reduce-scatter sent {state.bytes_sent} bytes from rank 0)")


if __name__ == "__main__":
    run(main)

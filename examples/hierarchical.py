"""Hierarchical compression: exact inside a node, 1 bit between nodes, for the collective and 1-bit Adam.

    python examples/hierarchical.py                         # 4 local ranks, taken as 2 nodes of 2
    torchrun --nproc-per-node 4 examples/hierarchical.py    # the same under torchrun
    # 2 nodes x 4 ranks: run on every node (HOST0: the first node's address)
    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HOST0:29500 examples/hierarchical.py

`compcomm.backends.get("hierarchical")` groups the ranks by node (LOCAL_WORLD_SIZE, which
torchrun sets; ranks numbered node-major): inside a node the tensor is reduce-scattered exactly,
through shared memory on CPU, and each rank runs the 1-bit algorithm across nodes on its part, so
only 1/k of the tensor leaves each of a node's k ranks, in 1 bit. On one machine this example
takes its ranks as nodes of 2, to show the calls; what hierarchy buys depends on your links and
cores (docs/performance.md). Any `backend=` takes it: the collective, the optimizers, the DDP hook.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

import compcomm
from compcomm.optim import OnebitAdam

from _ranks import run, same_on_every_rank, say

WARMUP = 3


def ranks_per_node() -> int:
    """torchrun's LOCAL_WORLD_SIZE, or nodes of 2 when every rank is on this machine."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    return 2 if local == dist.get_world_size() and local % 2 == 0 else local


def main() -> None:
    rank = dist.get_rank()
    k = ranks_per_node()
    hier = compcomm.backends.get("hierarchical", local_world_size=k)  # collective: every rank builds it
    flat = compcomm.backends.get("gloo")

    grad = torch.randn(1_000_000, generator=torch.Generator().manual_seed(rank))
    results, sent = {}, {}
    for name, be, counted in (("flat", flat, flat), ("hierarchical", hier, hier.inter)):
        out, ef = grad.clone(), compcomm.ErrorFeedback()  # an ErrorFeedback serves one backend's layout
        before = counted.bytes_sent  # the flat call's bytes, the hierarchical call's across nodes
        compcomm.compressed_allreduce(out, ef, backend=be)
        results[name], sent[name] = out, counted.bytes_sent - before
    say(f"rank 0 sent {sent['flat']} bytes in the flat call, {sent['hierarchical']} across nodes in the hierarchical")
    assert same_on_every_rank([results["hierarchical"]])  # bitwise the same everywhere, like the flat call

    torch.manual_seed(0)  # every rank starts from the same parameters
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    opt = OnebitAdam(model.parameters(), lr=1e-2, freeze_step=WARMUP, backend=hier)
    for step in range(8):
        x = torch.randn(64, 32, generator=torch.Generator().manual_seed(1000 * step + rank))
        loss = torch.nn.functional.mse_loss(model(x), x[:, :8].sum(dim=1, keepdim=True))
        opt.zero_grad()
        loss.backward()
        opt.step()  # momentum averaged exactly inside the node, in 1 bit across nodes after WARMUP
        if step in (0, 7):
            say(f"step {step}: loss {loss.item():.4f}")
    assert same_on_every_rank(list(model.parameters()))
    say(f"hierarchical: OK (nodes x ranks per node: {dist.get_world_size() // k} x {k})")


if __name__ == "__main__":
    run(main)

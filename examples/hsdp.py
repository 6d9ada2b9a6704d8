"""HSDP: shards inside each node (FSDP2, exact), shards averaged across nodes in 1 bit.

    python examples/hsdp.py                                 # 4 local ranks: 2 "nodes" of 2, spawned here
    torchrun --nproc-per-node 4 examples/hsdp.py            # the same under torchrun
    # 2 nodes x 4 ranks: run on every node (HOST0: the first node's address); shards inside a node
    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HOST0:29500 examples/hsdp.py

Each replica (a node: LOCAL_WORLD_SIZE ranks; on one machine, half of the ranks stand for a node)
shards the model with `fully_shard` on a 1-D mesh of its own ranks, and FSDP's reduce-scatter
inside it stays exact. `compcomm.fsdp.compress(model, replicate_group=G)` then averages each
rank's gradient shard across the replicas in G (the ranks holding the same shard on the other
nodes) with the 1-bit allreduce, after `start_iter` exact iterations. Only the traffic between
nodes is compressed. FSDP's own 2-D-mesh HSDP cannot be compressed (its all-reduce has no seam):
build the 1-D meshes as here.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

import compcomm

from _ranks import checkpoint_dir, run, same_on_every_rank, say


def main() -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    k = per_node if per_node < world else world // 2  # ranks per replica
    nodes = world // k
    # Every rank creates every group, in the same order.
    shard_groups = [dist.new_group(list(range(h * k, (h + 1) * k))) for h in range(nodes)]
    replica_groups = [dist.new_group([h * k + i for h in range(nodes)]) for i in range(k)]

    torch.manual_seed(rank)  # compress() makes the replicas equal (the first replica's parameters)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    mesh = DeviceMesh.from_group(shard_groups[rank // k], "cpu")  # "cuda" on GPUs
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    state = compcomm.fsdp.compress(model, start_iter=3, replicate_group=replica_groups[rank % k])
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    for step in range(8):
        x = torch.randn(64, 32, generator=torch.Generator().manual_seed(1000 * step + rank))
        loss = torch.nn.functional.mse_loss(model(x), x[:, :8].sum(dim=1, keepdim=True))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step in (0, 7):
            say(f"step {step}: loss {loss.item():.4f}, 1-bit across nodes: {state.compressing}")
    assert same_on_every_rank([p.full_tensor() for p in model.parameters()])
    with checkpoint_dir() as ckpt:  # a fresh directory, removed afterwards
        torch.save(state.state_dict(), ckpt / f"hsdp_rank{rank}.pt")  # the error feedback: one file per rank
    say(f"hsdp: OK ({nodes} replicas of {k} shards, parameters equal on every rank)")


if __name__ == "__main__":
    run(main)

"""FSDP2 layouts the benchmarks share: hosts of k consecutive ranks, and a model sharded per child.

HSDP shards inside a host and replicates across hosts: the shard group of a rank is its host's
k ranks, its replica group the ranks of the same local index on every host. `new_group` is
collective, so every rank creates every group; each rank gets back its own two.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def host_groups(k: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(this rank's shard group: its host's k ranks, its replica group: the ranks of its local
    index on every host), hosts being consecutive blocks of k ranks."""
    world, rank = dist.get_world_size(), dist.get_rank()
    hosts = world // k
    shards = [dist.new_group(list(range(h * k, (h + 1) * k))) for h in range(hosts)]
    replicas = [dist.new_group([h * k + i for h in range(hosts)]) for i in range(k)]
    return shards[rank // k], replicas[rank % k]


def shard_children(model: torch.nn.Module, mesh) -> None:
    """fully_shard each child that trains parameters, then the model: one FSDP module per layer."""
    from torch.distributed.fsdp import fully_shard

    for child in model.children():
        if any(p.requires_grad for p in child.parameters()):
            fully_shard(child, mesh=mesh)
    fully_shard(model, mesh=mesh)

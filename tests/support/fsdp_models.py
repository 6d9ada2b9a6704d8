"""A small model sharded with FSDP2 on a group of the rank pool, and its data, for the tests of
compcomm.fsdp and of the optimizers on sharded parameters."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.fsdp import FSDPModule

from rankpool import group

NEEDS_FSDP_SEAMS = pytest.mark.skipif(
    not hasattr(FSDPModule, "set_reduce_scatter_unused_params"),
    reason=f"compcomm.fsdp needs FSDPModule.set_reduce_scatter_unused_params, which torch {torch.__version__} lacks "
    "(torch 2.11 lacks it, 2.13 has it): compress refuses such a torch, saying so",
)


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))


def shard(model: torch.nn.Module, members: tuple[int, ...], reduce_dtype: torch.dtype | None = None) -> torch.nn.Module:
    """fully_shard every Linear and the model, on a 1-D mesh over the pool's group `members`
    (gradients reduced in `reduce_dtype` if given: FSDP2's MixedPrecisionPolicy)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = DeviceMesh.from_group(group(members), "cpu")
    policy = MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def batch(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 5, generator=g) * (1 + rank)


def loss_of(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).pow(2).sum()


def full_params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.full_tensor().detach().clone() for p in model.parameters()]

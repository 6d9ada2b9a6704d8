"""The FSDP2 modules of a model, and the checks that they are sharded the way compcomm can serve.

compcomm plugs into FSDP2 through its public seams (`FSDPModule.set_custom_reduce_scatter`,
`set_all_reduce_hook`), one FSDP module at a time. A module qualifies when `fully_shard` was
called on it and it owns parameters, all sharded on one 1-D mesh: FSDP's own HSDP (a 2-D mesh)
all-reduces across replicas inside FSDP, where no seam reaches.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from ..backends import Backend

TWO_D_MESH_FIX = (
    "compcomm.fsdp compresses the cross-replica all-reduce of HSDP itself: shard each replica on a 1-D mesh "
    "of its own ranks (fully_shard(..., mesh=init_device_mesh(device, (ranks_per_replica,)) built per replica, "
    "or the shard dimension of your 2-D mesh, mesh['shard']) and pass the replica group: "
    "compcomm.fsdp.compress(model, replicate_group=mesh['replicate'].get_group())"
)


@dataclass
class ShardedModule:
    """One FSDP module that owns parameters."""

    name: str  # its name in the model ("" for the root)
    module: FSDPModule
    params: list[torch.nn.Parameter]  # the parameters it shards (DTensors)
    shard_group: dist.ProcessGroup  # the group its gradients are reduce-scattered over
    param_names: list[str]  # each parameter's name in its FSDP module, in the order FSDP lays them out

    def layout(self) -> list[list[str]]:
        """How FSDP lays out this module's gradients in its reduce-scatter: each parameter's name,
        shape and placement on the mesh, in order (what its error feedback lines up with)."""
        return [
            [name, str(list(p.shape)), str(getattr(p, "placements", ""))]
            for name, p in zip(self.param_names, self.params)
        ]


def sharded_modules(model: torch.nn.Module) -> list[ShardedModule]:
    """The FSDP modules of `model` that own parameters, in the order of `named_modules()`; the
    modules sharded together by one `fully_shard([a, b])` as one, named "a+b".

    ValueError for a model that `fully_shard` was not called on, for parameters that no FSDP
    module shards, and for a 2-D (HSDP) mesh."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"compcomm.fsdp.compress takes the model (an nn.Module), got {type(model).__name__}")
    fsdp = [(name, m) for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    if not fsdp:
        raise ValueError(
            "the model holds no FSDP module: call torch.distributed.fsdp.fully_shard on its layers and on the "
            "model first, then compcomm.fsdp.compress(model)"
        )
    owned: dict[int, str] = {}
    grouped: dict[int, tuple[list[str], FSDPModule, list[torch.nn.Parameter], list[str]]] = {}
    for name, module in fsdp:
        params = _own_parameters(module)
        for p in params:
            owned[id(p)] = name
        if params:  # `fully_shard([a, b])` gives a and b one state: one reduce-scatter of both
            names, _, together, param_names = grouped.setdefault(id(module._get_fsdp_state()), ([], module, [], []))
            names.append(name)
            together.extend(params)
            assert isinstance(module, torch.nn.Module)
            named = {id(p): n for n, p in module.named_parameters()}
            param_names.extend(named[id(p)] for p in params)
    found = []
    for names, module, params, param_names in grouped.values():
        name = "+".join(names)
        found.append(ShardedModule(name, module, params, _shard_group(name, params), param_names))
    loose = [name for name, p in model.named_parameters() if id(p) not in owned]
    if loose:
        raise ValueError(
            f"parameters {loose[:5]} are not sharded by any FSDP module: call fully_shard on the model itself too "
            "(its root), so that every parameter's gradient goes through FSDP"
        )
    return found


def _own_parameters(module: FSDPModule) -> list[torch.nn.Parameter]:
    """The parameters this FSDP module manages: its own, less those of FSDP modules nested in it."""
    assert isinstance(module, torch.nn.Module)
    nested = {
        id(p)
        for child in module.modules()
        if child is not module and isinstance(child, FSDPModule)
        for p in child.parameters()
    }
    return [p for p in module.parameters() if id(p) not in nested]


def _shard_group(name: str, params: list[torch.nn.Parameter]) -> dist.ProcessGroup:
    meshes = [p.device_mesh for p in params if isinstance(p, DTensor)]
    if not meshes or len(meshes) != len(params) or any(m != meshes[0] for m in meshes):
        raise ValueError(f"the FSDP module {name or '<root>'!r} shards its parameters on several meshes")
    mesh = meshes[0]  # equal meshes may be distinct objects (DTensor caches specs across models)
    if mesh.ndim != 1:
        raise ValueError(f"the FSDP module {name or '<root>'!r} is sharded on a {mesh.ndim}-D mesh. {TWO_D_MESH_FIX}")
    return mesh.get_group()


def group_ranks(group: dist.ProcessGroup) -> list[int]:
    """The global ranks of a torch.distributed group."""
    return dist.get_process_group_ranks(group)


def check_called_over(group: dist.ProcessGroup, be: Backend, what: str) -> None:
    """ValueError unless FSDP calls `what` over the group that `be` was built over (its size,
    and this rank's place in it)."""
    if dist.get_world_size(group) != be.world_size or dist.get_rank(group) != be.rank:
        raise ValueError(
            f"FSDP calls {what} over a group of {dist.get_world_size(group)} ranks (this one {dist.get_rank(group)}), "
            f"not the {be.world_size}-rank group compcomm.fsdp.compress built for it"
        )


def unsharded_gradients_dropped(module: FSDPModule) -> None:
    """Drop the gradients FSDP holds for `module`'s parameters unreduced: on the unsharded
    parameters it has registered now, and on those it keeps aside after resharding (and their
    accumulation in the reduce dtype under `set_requires_gradient_sync(False)`), which its
    `reset_iter_state` leaves for the next backward to add to. The latter are FSDP's own records
    (`FSDPParam`), reached past its seams where they exist."""
    assert isinstance(module, torch.nn.Module)
    for p in module.parameters():
        if not isinstance(p, DTensor):
            p.grad = None
    for record in _parameter_records(module):
        unsharded = getattr(record, "_unsharded_param", None)
        if unsharded is not None:
            unsharded.grad = None
        if getattr(record, "unsharded_accumulated_grad", None) is not None:
            record.unsharded_accumulated_grad = None


def unsharded_parameters(module: FSDPModule) -> list[torch.nn.Parameter]:
    """The unsharded parameters FSDP has made for `module` (those its forward computes with, whose
    gradients autograd accumulates), from FSDP's own records (`FSDPParam`)."""
    found = (getattr(record, "_unsharded_param", None) for record in _parameter_records(module))
    return [p for p in found if p is not None]


def holds_unreduced_gradients(module: FSDPModule) -> bool:
    """Whether FSDP holds gradients of `module`'s parameters that it has not reduced (micro-batches
    run under `set_requires_gradient_sync(False)`): where `unsharded_gradients_dropped` drops them."""
    for record in _parameter_records(module):
        unsharded = getattr(record, "_unsharded_param", None)
        if unsharded is not None and unsharded.grad is not None:
            return True
        if getattr(record, "unsharded_accumulated_grad", None) is not None:
            return True
    return False


def _parameter_records(module: FSDPModule) -> list[Any]:
    """FSDP's records (`FSDPParam`) of `module`'s parameters, past its seams, where they exist."""
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None) or [getattr(state, "_fsdp_param_group", None)]
    return [record for group in groups for record in getattr(group, "fsdp_params", ())]


def grad_tensors(output: Any) -> list[torch.Tensor]:
    """The tensors that require gradients in a forward's `output`, at any depth of tensors,
    dicts, lists, tuples (NamedTuples too) and dataclass instances: where FSDP2 looks for the
    outputs it hooks its pre-backward to. Written here because torch's helper for it is private
    and missing from older torch (2.11)."""
    found: list[torch.Tensor] = []
    todo, seen = [output], set()
    while todo:
        item = todo.pop()
        if isinstance(item, torch.Tensor):
            if item.requires_grad:
                found.append(item)
            continue
        if id(item) in seen:  # a structure that holds itself
            continue
        seen.add(id(item))
        if dataclasses.is_dataclass(item) and not isinstance(item, type):
            todo += [getattr(item, field.name) for field in dataclasses.fields(item)]
        elif isinstance(item, dict):
            todo += list(item.values())
        elif isinstance(item, (list, tuple)):
            todo += list(item)
    return found

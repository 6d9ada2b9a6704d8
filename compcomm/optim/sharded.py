"""A step of a compressed optimizer on FSDP2-sharded parameters: FSDP moves the gradients.

Under `compcomm.fsdp.compress`, FSDP2 reduces each gradient to its shard: exactly for the first
`start_iter` iterations, then with 1 bit and error feedback. The optimizer then sends nothing
itself; its state lives on the shards, and its update rules run on each rank's shard as they
would on the whole tensor, with one difference in what the 1-bit stage compresses: the gradient,
before the momentum is formed from it (m = beta1 m + (1 - beta1) g_1bit, with the variance
frozen at the switch), instead of the momentum. Per-layer quantities (LAMB's norms) are reduced
across the shards of each parameter. The stages must switch together: the optimizer's
`freeze_step` is the compression's `start_iter`, and one backward that reduces gradients comes
per step (accumulate micro-batches with `model.set_requires_gradient_sync(False)`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ..agreement import all_sum
from ..errors import all_finite
from .shards import compression_of, is_dtensor, local

if TYPE_CHECKING:
    from ..fsdp.state import CompressionState


class ShardedOwner(Protocol):
    """What a sharded step asks of its optimizer."""

    param_groups: list[dict[str, Any]]

    def _kind(self, t: int) -> str: ...

    def _switch_step(self) -> int | None: ...

    def _payload(
        self, t: int, kind: str, p: torch.Tensor, group: dict[str, Any], g: torch.Tensor, out: torch.Tensor
    ) -> None: ...


def is_sharded(params: Sequence[torch.Tensor]) -> bool:
    """Whether the parameters are FSDP2's (DTensors); ValueError for a mix."""
    sharded = [is_dtensor(p) for p in params]
    if any(sharded) and not all(sharded):
        raise ValueError(
            "the optimizer got both sharded (DTensor) and plain parameters: give it one model's parameters"
        )
    return bool(sharded) and all(sharded)


class ShardedSteps:
    """The verdict and the payloads of each step, on the local shards."""

    def __init__(self, owner: ShardedOwner) -> None:
        self.owner = owner
        self._buffers: dict[int, torch.Tensor] = {}

    def params(self) -> list[torch.Tensor]:
        return [p for group in self.owner.param_groups for p in group["params"]]

    @property
    def state(self) -> CompressionState:
        """The compression of the model these parameters belong to."""
        states = {id(compression_of(p)): compression_of(p) for p in self.params()}
        found = [s for s in states.values() if s is not None]
        if len(states) != 1 or not found:
            raise ValueError(
                f"{type(self.owner).__name__} got FSDP2-sharded parameters whose gradients compcomm does not reduce: "
                "call compcomm.fsdp.compress(model, start_iter=freeze_step) on every rank before the first backward "
                "(sharded parameters without it would be averaged by FSDP in fp32 while this optimizer freezes its "
                "variance for 1-bit gradients that never come)"
            )
        return found[0]

    def agree(self, t: int, found_inf: bool) -> bool:
        """Step t's verdict over every rank of the model: is some rank's gradient shard
        non-finite (or its GradScaler's inf check)? ValueError when the optimizer and the
        compression are out of step (the same on every rank: they count the same backwards)."""
        state = self.state
        switch = self.owner._switch_step()
        if switch is not None and switch != state.start_iter:
            raise ValueError(
                f"{type(self.owner).__name__}'s freeze_step ({switch}) must equal the start_iter of "
                f"compcomm.fsdp.compress ({state.start_iter}): the variance freezes when the gradients turn 1-bit"
            )
        local_bad = found_inf or any(g is not None and not all_finite(g) for g in self._grads())
        skipped = bool(all_sum([float(local_bad)], state.world)[0])
        # A backward whose gradients were non-finite is not counted (nonfinite="propagate"
        # hands them on as NaN for a GradScaler, which still calls step() so that it skips).
        counted = state.iteration == t or (skipped and state.iteration == t - 1)
        if not counted and state.world.world_size > 1:  # alone, FSDP reduces nothing to count
            raise ValueError(
                f"step {t} follows {state.iteration} reducing backward passes: one reducing backward per step keeps "
                "the optimizer's stages in step with the compression's (accumulate micro-batches under "
                "model.set_requires_gradient_sync(False), and call step() after each reducing backward)"
            )
        return skipped

    def _grads(self) -> list[torch.Tensor | None]:
        return [None if p.grad is None else local(p.grad) for p in self.params()]

    def values(self, t: int, kind: str, scale: float | None) -> list[torch.Tensor]:
        """Each parameter's payload (the reduced gradient shard in warm-up, this step's momentum
        after it), in parameter order."""
        values = []
        for group in self.owner.param_groups:
            for p in group["params"]:
                shard = local(p)
                g = p.grad
                g = torch.zeros_like(shard, dtype=torch.float32) if g is None else local(g).float()
                if scale is not None:
                    g = g / scale
                out = self._buffers.get(id(p))
                if out is None:
                    out = self._buffers[id(p)] = torch.empty_like(shard, dtype=torch.float32)
                self.owner._payload(t, kind, p, group, g, out)
                values.append(out)
        return values

    def all_sum(self, p: torch.Tensor, values: list[float]) -> list[float]:
        """Sums over the ranks that hold shards of `p`."""
        return all_sum(values, self.state.shard_backend(p))

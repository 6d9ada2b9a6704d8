"""torch.amp.GradScaler with an optimizer whose ranks step on their own gradients (DiLoCo).

GradScaler checks the gradients for inf/NaN before it calls `step()` and lowers its scale in
`update()` when it found some. For the scales to stay equal on every rank, every rank's check
must find the same answer, so at the end of each backward the ranks agree on whether any rank's
gradients are non-finite, and a rank whose own are finite then marks one of its gradients NaN
(`BackwardAgreement`). `step()` receives the scaler's scale and verdict (torch's
`_step_supports_amp_scaling` protocol) and unscales the gradients itself (`unscale_and_check`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence

import torch

from ..agreement import all_sum
from ..backends import Backend
from ..errors import all_finite
from .readiness import Readiness


def unscale_and_check(params: Sequence[torch.Tensor], scale: torch.Tensor | None) -> bool:
    """Whether any parameter's gradient holds NaN/Inf; when `scale` is given, every gradient is
    first multiplied in place by its fp32 reciprocal, as GradScaler.unscale_ does (one fused
    pass per device and dtype)."""
    grads: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
    for p in params:
        if p.grad is not None:
            if p.grad.is_sparse:
                raise RuntimeError("DiLoCo does not support sparse gradients")
            grads[(p.grad.device, p.grad.dtype)].append(p.grad)
    found = False
    for (device, _), group in grads.items():
        flag = torch.zeros(1, device=device)
        inverse = torch.ones(1, device=device) if scale is None else scale.double().reciprocal().float().to(device)
        torch._amp_foreach_non_finite_check_and_unscale_(group, flag, inverse)
        found = found or bool(flag.item())
    return found


def agree_nonfinite(grads: Sequence[torch.Tensor | None], backend: Backend) -> bool:
    """Whether some rank's gradients are non-finite (one all-reduce); if so, a rank whose own are
    finite marks its first gradient NaN, so that every rank's GradScaler finds the inf."""
    mine = any(g is not None and not all_finite(g) for g in grads)
    total = all_sum([1.0 if mine else 0.0], backend)[0]
    if total and not mine:
        mark_nonfinite(grads)
    return bool(total)


def mark_nonfinite(grads: Iterable[torch.Tensor | None]) -> None:
    """Set the first element of the first non-empty gradient to NaN: what a rank whose own
    gradients are finite does when another rank's are not, so that its GradScaler's inf check
    finds one too and every rank's scale backs off alike."""
    first = next((g for g in grads if g is not None and g.numel()), None)
    if first is not None:
        first[(0,) * first.dim()] = float("nan")


class BackwardAgreement:
    """Runs `agree_nonfinite` at the end of the first backward (whether a scaler is used is not
    known yet; or at the first step, where that comes first: `at_step`) and of every backward
    once a scaler is known (`given` at construction, or seen at a step): one 8-byte all-reduce
    each, and none at all without a scaler. The end of a
    backward nested in one (reentrant checkpointing's region) counts as an end: if every
    gradient comes in nested ones, no other comes before the scaler's check. `agreed` tells
    `step()` whether the last backward agreed."""

    def __init__(self, params: Sequence[torch.Tensor], backend: Callable[[], Backend], given: bool = False) -> None:
        self._params = list(params)
        self._backend = backend
        self._given = given
        self.scaler_seen = given
        self.agreed = False
        self._first = True
        self.readiness = Readiness(self._params, lambda i: None, self._backward_done, self._nested_backward_done)

    def state_dict(self) -> dict[str, bool]:
        """What a resumed run needs to agree where this one would: whether the first backward has
        been (a resumed run's first backward is not the run's first) and whether a scaler was seen."""
        return {"first_done": not self._first, "scaler_seen": self.scaler_seen}

    def load_state_dict(self, state: dict[str, bool]) -> None:
        self._first, self.scaler_seen = not state["first_done"], bool(state["scaler_seen"]) or self._given
        self.agreed = False

    def scaler_verdict(self, found: bool) -> bool:
        """At a `GradScaler.step`: whether its check found inf/NaN, the same on every rank. Agreed
        at the end of the backward; else (no backward since the last step, or one that was not
        agreed because the scaler was not known yet) agreed now, and ValueError on every rank if
        the ranks' scalers found different answers: each one has already taken its own, so their
        scales would part."""
        if not self.agreed:
            be = self._backend()
            total = int(all_sum([float(found)], be)[0])
            if 0 < total < be.world_size:
                raise ValueError(
                    f"DiLoCo: the GradScaler found inf/NaN on {total} of {be.world_size} ranks in a backward that "
                    "DiLoCo did not compare across ranks, not knowing of the scaler yet (one past the run's first "
                    "before the first scaler.step: a later micro-batch, a scaler switched on after steps without "
                    "one, a resume from a state saved without one): the ranks' scales would part. Build DiLoCo "
                    "with grad_scaler=scaler, so that every backward is compared"
                )
            found = total > 0
        self.scaler_seen = True
        return found

    def at_step(self) -> None:
        """A step that comes before this rank's first backward has ended (a rank with no batch
        yet, whose `step()` counts all the same): the first agreement runs here, paired with
        the other ranks' at the end of their first backwards, so that every rank takes part in
        it once, and then runs its own collectives in step with theirs."""
        if self._first:
            self._backward_done()

    def _backward_done(self) -> None:
        self._nested_backward_done()
        self._first = False

    def _nested_backward_done(self) -> None:
        """Agreed as the end of the backward it is nested in is, without ending it: the run's
        first backward stays the first until its own end."""
        self.agreed = self._first or self.scaler_seen
        if self.agreed:
            agree_nonfinite([p.grad for p in self._params], self._backend())

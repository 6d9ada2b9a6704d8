"""One step's communication, from the first ready gradient to `step()`: a round of bucket collectives.

Each step t sends one payload per parameter, of the kind the optimizer names:

    kind(t) = "exact"        averaged with the uncompressed all-reduce (e.g. gradients in warm-up)
              "compressed"   averaged with the 1-bit `compressed_allreduce`, one ErrorFeedback per
                             bucket (e.g. momenta after the freeze)
              "local"        nothing is sent (0/1 Adam's local steps)

A bucket's collective starts as soon as the last of its gradients is accumulated during backward
(`Readiness`) and every bucket before it has started, so communication overlaps the rest of
backward; buckets follow the order in which gradients became ready in the first backward (agreed
across ranks, else the reverse parameter order everywhere). Starting them strictly in that order
pairs bucket b with bucket b on every rank, also where gradients become ready in another order on
some rank, or never (an unused parameter: its bucket starts at the end of backward, with zeros).
A rank whose step follows no backward (no batch, every gradient None) first does what the end of
a backward does (`backward_missed`), so that its collectives pair with those of the ranks that
ran one. `agree()` takes the step's verdict in one tiny all-reduce: is some rank's
gradient non-finite, and did some rank change its gradients after backward (clipping,
`GradScaler.unscale_`), in which case every rank sends again from the current gradients (correct,
but not overlapped); the same all-reduce refuses, on every rank, sparse gradients on any rank.
Results are bitwise those of sending everything in `step()`: the same payloads go through the
same collectives; only the time they start differs.

GradScaler: once a scaler has been seen, the ranks also agree at the end of each backward on
whether any gradient is non-finite, and a rank whose own gradients are finite then marks one of
them NaN, so that every rank's scaler, whose inf check runs before `step()`, backs off alike. The
first backward is agreed the same way (no scaler has been seen yet), and its payloads go out in
`step()`. A step without a backward under a scaler is refused on every rank: that rank's
agreement would come after its scaler's inf check.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch.profiler import record_function

from ..agreement import all_sum
from ..allreduce import compressed_allreduce
from ..backends import Backend
from ..backends.ordering import Pending
from ..error_feedback import ErrorFeedback
from ..errors import NonFiniteError, all_finite
from .buckets import BucketLayout
from .readiness import Readiness
from .scaler import mark_nonfinite
from .timing import CommClock, CommTiming

EXACT, COMPRESSED, LOCAL = "exact", "compressed", "local"
_HASH_MOD = 1 << 20


class Payloads(Protocol):
    """What a round asks of its optimizer."""

    bucket_bytes: int
    overlap: bool
    param_groups: list[dict[str, Any]]

    @property
    def step_count(self) -> int: ...

    def _kind(self, t: int) -> str: ...

    def _payload(
        self, t: int, kind: str, p: torch.Tensor, group: dict[str, Any], g: torch.Tensor, out: torch.Tensor
    ) -> None: ...

    def _fresh_errors(self, t: int) -> bool: ...

    def _payload_shows_nonfinite(self, kind: str) -> bool: ...

    def _settings_key(self) -> float: ...

    def _refuse_differing_settings(self, be: Backend) -> None: ...


@dataclass
class Launch:
    handle: Pending | None  # None: nothing sent (a local step)
    errors: ErrorFeedback | None  # the bucket's error feedback after the call, kept if the step completes


@dataclass
class Round:
    """The communication of step t."""

    t: int
    kind: str
    scale: float | None
    launches: dict[int, Launch] = field(default_factory=dict)  # buckets 0..len-1 started, in order
    waiting: list[set[int]] = field(default_factory=list)  # per bucket: parameters not yet ready
    versions: list[Any] | None = None  # the gradients at the end of backward (None: not ended)
    nonfinite: bool | None = None  # the verdict, when the ranks took it at the end of the first backward
    clock: CommClock = field(default_factory=CommClock)


class GradientRounds:
    """The bucket layout and the rounds of an optimizer that owns its gradient communication."""

    def __init__(self, owner: Payloads, backend: Callable[[], Backend], tag: str) -> None:
        self.owner, self._backend, self._tag = owner, backend, tag
        self.layout: BucketLayout | None = None
        self.round: Round | None = None
        self.last_scale: float | None = None  # the GradScaler scale of the last step (None: none, or unscaled)
        self._groups: tuple[list[dict[str, Any]] | None, list[dict[str, Any]]] = (None, [])  # see `groups`
        self.scaler_seen = False  # a GradScaler drove a step: every backward's end agrees on non-finite gradients
        self.resumed = False  # loaded from a state: the next backward's end agrees, as a run's first one does
        self._missed_under_scaler = False  # this step's backward was missed under a GradScaler
        self._agreed_nested = False  # a nested backward's end agreed on non-finite gradients since the last end
        self.readiness = Readiness(self.params(), self._grad_ready, self._backward_done, self._nested_backward_done)

    # ----------------------------------------------------------------- layout

    def params(self) -> list[torch.Tensor]:
        return [p for group in self.owner.param_groups for p in group["params"]]

    def groups(self) -> list[dict[str, Any]]:
        """Each parameter's group, as the optimizer holds it now: `load_state_dict` replaces the
        list of group dicts (a scheduler moves the settings inside them, which the payloads
        read), so the lookup is rebuilt whenever the list is another."""
        groups = self.owner.param_groups
        if self._groups[0] is not groups:
            self._groups = (groups, [group for group in groups for _ in group["params"]])
        return self._groups[1]

    @property
    def backend(self) -> Backend:
        return self._backend()

    def lay_out(self, order: Sequence[int] | None = None) -> BucketLayout:
        """The buckets, built once, parameters taken in `order` (default: the reverse of the
        parameter order, the usual order of readiness)."""
        if self.layout is None:
            params = self.params()
            taken = list(order) if order is not None else list(range(len(params)))[::-1]
            self.layout = BucketLayout(params, taken, self.owner.bucket_bytes, self.backend.world_size, self._tag)
        return self.layout

    def _ready_order(self) -> list[int]:
        """The order of readiness seen so far, then the remaining parameters in reverse order."""
        seen = self.readiness.order
        rest = [i for i in range(len(self.params()))[::-1] if i not in set(seen)]
        return seen + rest

    @staticmethod
    def _order_key(order: Sequence[int]) -> float:
        return float(hash(tuple(order)) % _HASH_MOD)

    def _lay_out_if_agreed(self, order: list[int], keys: float, squares: float) -> None:
        """Lay out in `order` if every rank saw it (the sums of a key and its square match n
        copies of this rank's), else in the reverse parameter order everywhere."""
        agreed = _same_on_every_rank(self._order_key(order), keys, squares, self.backend.world_size)
        self.lay_out(order if agreed else None)

    # ----------------------------------------------------------------- gradients

    def grads(self) -> list[torch.Tensor | None]:
        return [p.grad for p in self.params()]

    def _sparse(self) -> bool:
        """Whether this rank holds a sparse gradient: refused in the next agreement, on every
        rank (`_refuse`); until then it is sent as zeros, so that the collectives pair."""
        return any(g is not None and g.is_sparse for g in self.grads())

    def _refuse(self, sparse: float, missed: float) -> None:
        """Raise on every rank (each passes the same agreed counts) if some rank holds sparse
        gradients, or stepped without a backward under a GradScaler (`backward_missed`)."""
        self._missed_under_scaler = False
        if sparse:
            self.cancel()
            raise RuntimeError(
                f"the compressed optimizers do not support sparse gradients ({sparse:g} rank(s) hold some, "
                "e.g. from nn.Embedding(sparse=True))"
            )
        if missed:
            self.cancel()
            raise ValueError(
                f"{missed:g} rank(s) called step() without a backward under a GradScaler, whose check for inf "
                "gradients runs before step(): their scale would part from the other ranks'. Run a backward on "
                "every rank, of a zero loss where a rank has no batch (e.g. 0 * sum(p.sum() for p in params))"
            )

    @staticmethod
    def _versions(grads: Sequence[torch.Tensor | None]) -> list[Any]:
        return [None if g is None else (id(g), g._version) for g in grads]

    def locally_nonfinite(self, found_inf: bool = False) -> bool:
        """Whether this rank's gradients hold NaN/Inf (or its GradScaler found some)."""
        return found_inf or any(g is not None and not g.is_sparse and not all_finite(g) for g in self.grads())

    # ----------------------------------------------------------------- rounds

    def _new_round(self, scale: float | None) -> Round:
        t = self.owner.step_count + 1
        rnd = Round(t=t, kind=self.owner._kind(t), scale=scale)
        params, layout = self.params(), self.lay_out()
        rnd.waiting = [{i for i in layout.parameters_of(b) if params[i].requires_grad} for b in range(len(layout))]
        return rnd

    def cancel(self) -> None:
        """Drop the current round: wait for its collectives and forget their results."""
        rnd, self.round = self.round, None
        if rnd is None:
            return
        for launch in rnd.launches.values():
            try:
                if launch.handle is not None:
                    launch.handle.wait()
            except Exception:
                pass  # the round is dropped: its results (and failures) no longer matter

    def _current_round(self) -> Round:
        """The round of the coming step; a backward after the last one ended starts it over."""
        rnd = self.round
        if rnd is None or rnd.versions is not None or rnd.t != self.owner.step_count + 1:
            self.cancel()
            rnd = self.round = self._new_round(self.last_scale)
        return rnd

    def _launch(self, rnd: Round, b: int) -> None:
        """Fill bucket b with this rank's payloads and start its collective (if the step sends)."""
        layout, params, groups = self.lay_out(), self.params(), self.groups()
        bucket = layout.buckets[b]
        with record_function("compcomm.optim.payload"):
            for view, i in zip(bucket.views, layout.parameters_of(b)):
                p = params[i]
                g = p.grad
                if g is None or g.is_sparse or not p.requires_grad:
                    g = torch.zeros_like(p, dtype=torch.float32)
                else:
                    g = g.float()
                if rnd.scale is not None:
                    g = g / rnd.scale
                self.owner._payload(rnd.t, rnd.kind, p, groups[i], g, view.view_as(p))
        if rnd.kind == LOCAL:
            rnd.launches[b] = Launch(None, None)
            return
        with record_function("compcomm.optim.submit"):
            rnd.launches[b] = self._submit(rnd, b)

    def _submit(self, rnd: Round, b: int) -> Launch:
        """Start bucket b's collective on its filled buffer."""
        layout, be = self.lay_out(), self.backend
        flat = layout.buckets[b].flat
        index = rnd.clock.submit()
        if rnd.kind == EXACT:
            launch = Launch(be.all_reduce(flat, "mean", async_op=True), None)
        else:
            # The call starts from the kept error feedback and writes the new errors into the
            # bucket's spare; the two swap roles if the whole step completes (`finish`).
            work = layout.spare[b]
            # errors restarted from zero: an unused source (the spare's buffers are zeroed, kept)
            source = ErrorFeedback(tag=work.tag) if self.owner._fresh_errors(rnd.t) else layout.error_feedback[b]
            handle = compressed_allreduce(flat, source, backend=be, op="mean", async_op=True, error_feedback_out=work)
            launch = Launch(handle, work)
        assert launch.handle is not None
        launch.handle.get_future().add_done_callback(lambda _: rnd.clock.complete(index))
        return launch

    def launch_rest(self, rnd: Round) -> None:
        for b in range(len(rnd.launches), len(self.lay_out())):
            self._launch(rnd, b)

    # ----------------------------------------------------------------- backward's signals

    def _grad_ready(self, i: int) -> None:
        """Parameter i's gradient is accumulated: start its bucket if that completes it."""
        if not self.owner.overlap or self.layout is None:
            return
        rnd = self._current_round()
        if rnd.kind == LOCAL:
            return
        rnd.waiting[self.layout.bucket_of[i]].discard(i)
        b = len(rnd.launches)
        while b < len(rnd.waiting) and not rnd.waiting[b]:
            self._launch(rnd, b)
            b += 1

    def _backward_done(self) -> None:
        """A backward ended: start the buckets left (their gradients never came: zeros) and note
        the gradients sent. At the first backward, and at every backward once a GradScaler has
        been seen, the ranks also agree here on whether any gradient is non-finite
        (`_agree_before_scaler`); the first time, the same all-reduce agrees on the order of
        readiness, and the buckets are laid out."""
        if self.layout is None:
            order = self._ready_order()
            key = self._order_key(order)
            nonfinite, keys, squares = self._agree_before_scaler([key, key * key])
            self._lay_out_if_agreed(order, keys, squares)
            rnd = self.round = self._new_round(self.last_scale)
            rnd.nonfinite = nonfinite  # its payloads go out in step(), from the gradients as they are then
        else:
            rnd = self._current_round()
            rnd.clock.backward_ended()
            if self.owner.overlap and rnd.kind != LOCAL:
                self.launch_rest(rnd)
            if self._agrees_at_ends:
                self._agree_before_scaler([])
        rnd.versions = self._versions(self.grads())
        self._agreed_nested = self.resumed = False

    def _nested_backward_done(self) -> None:
        """A backward nested in this one ended (reentrant checkpointing's region): nothing starts,
        the outer one may bring more gradients. Where a GradScaler may check the gradients before
        `step()` (one was seen, or this is the first backward, where one may be), the ranks agree
        on non-finite ones here all the same: if every gradient comes in nested backward passes,
        no later end comes before that check, and `step()` relies on this agreement."""
        if self._agrees_at_ends:
            self._agree_before_scaler([])
            self._agreed_nested = True

    @property
    def _agrees_at_ends(self) -> bool:
        """Whether a backward's end agrees on non-finite gradients, before a GradScaler checks
        them: the run's first backward (a scaler is not known yet), a resumed run's first, and
        every one once a scaler has driven a step."""
        return self.layout is None or self.resumed or self.scaler_seen

    def backward_missed(self, t: int, scaled: bool) -> None:
        """Before step t's first collective: if no backward ended on this rank since the last
        step, do what the end of one does (start the buckets, from the gradients as they are,
        None counting as zeros; the agreements taken there), as the ranks that ran one did.
        Under a GradScaler (`scaled`) that is refused on every rank in the next agreement: the
        scaler checked this rank's gradients for inf before `step()`, without the NaN that the
        agreement at the end of a backward gives them when another rank's overflowed, so its
        scale would part from the others'."""
        rnd = self.round
        if rnd is None or rnd.t != t or rnd.versions is None:
            self._missed_under_scaler = scaled and not self._agreed_nested
            self._backward_done()

    def _agree_before_scaler(self, extra: list[float]) -> list[Any]:
        """All-reduce of (some rank's gradients are non-finite, *extra); a rank whose own are
        finite then marks one of them NaN, so that a GradScaler's inf check, which runs before
        `step()`, finds the inf on every rank and every scale backs off alike."""
        nonfinite = self.locally_nonfinite()
        missed, sparse = float(self._missed_under_scaler), float(self._sparse())
        total, sparse, missed, *rest = all_sum([float(nonfinite), sparse, missed, *extra], self.backend)
        self._refuse(sparse, missed)
        if total and not nonfinite:
            mark_nonfinite(self.grads())
        return [bool(total), *rest]

    # ----------------------------------------------------------------- the step

    def agree(self, t: int, scale: float | None, found_inf: bool) -> tuple[bool, Round]:
        """Step t's verdict (whether some rank's gradients are non-finite, taken now or at the
        first backward) and its round."""
        rnd = self.round
        if rnd is not None and rnd.nonfinite is not None and rnd.t == t:  # agreed at the first backward
            rnd.scale = scale
            return rnd.nonfinite, rnd
        nonfinite = self._verdict(scale, found_inf)
        assert self.round is not None  # _verdict opened this step's round
        return nonfinite, self.round

    def _verdict(self, scale: float | None, found_inf: bool) -> bool:
        """The step's one all-reduce: is some rank's gradient non-finite? did some rank change its
        gradients after backward (or skip backward's hooks), so that every rank must send again?
        does some rank hold a sparse gradient (refused on every rank)? do the ranks hold the same
        settings now (a learning rate changed on one rank: refused on every rank)? and, if the
        buckets are not laid out yet, do the ranks see the same order of readiness? Returns the
        first answer."""
        rnd, t = self.round, self.owner.step_count + 1
        stale = rnd is None or rnd.t != t or rnd.scale != scale or rnd.versions != self._versions(self.grads())
        order = self._ready_order()
        key = self._order_key(order)
        kind = self.owner._kind(t)
        this_rank = found_inf or (not self.owner._payload_shows_nonfinite(kind) and self.locally_nonfinite())
        settings = self.owner._settings_key()
        flags = [float(this_rank), float(stale), float(self._sparse()), float(self._missed_under_scaler)]
        sums = all_sum([*flags, key, key * key, settings, settings * settings], self.backend)
        nonfinite, restart, sparse, missed, keys, squares, settings_sum, settings_squares = sums
        self._refuse(sparse, missed)
        if not _same_on_every_rank(settings, settings_sum, settings_squares, self.backend.world_size):
            self.cancel()
            self.owner._refuse_differing_settings(self.backend)
        if self.layout is None:
            self._lay_out_if_agreed(order, keys, squares)
        if restart or self.round is None:
            self.cancel()
            self.round = self._new_round(scale)
        return bool(nonfinite)

    def collect(self, rnd: Round) -> tuple[list[torch.Tensor], Exception | None]:
        """Wait for every bucket; the averaged (or local) payloads in parameter order, and why
        the step must be skipped (the same on every rank), if it must."""
        failure: Exception | None = None
        for launch in rnd.launches.values():
            try:
                if launch.handle is not None:
                    launch.handle.wait()
            except NonFiniteError as exc:
                failure = failure or exc
        layout = self.lay_out()
        if failure is None and rnd.kind == EXACT and not all(all_finite(b.flat) for b in layout.buckets):
            failure = NonFiniteError("the average of finite values overflowed fp32")
        return layout.values(len(self.params())), failure

    def finish(self, rnd: Round) -> CommTiming:
        """The step of `rnd` succeeded on every rank: keep each bucket's new errors; its timing."""
        self.round = None
        layout = self.lay_out()
        for b, launch in rnd.launches.items():
            if launch.errors is not None:
                layout.keep(b, launch.errors)
        return rnd.clock.timing()


def _same_on_every_rank(value: float, total: float, squares: float, n: int) -> bool:
    """Whether every one of the n ranks holds `value`, from the sums over ranks of it and of its
    square (n equal values are the only ones giving both n v and n v^2; exact for the small
    integers the keys are)."""
    return total == n * value and squares == n * value * value

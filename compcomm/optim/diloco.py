"""DiLoCo (Douillard et al. 2023) and Streaming DiLoCo (Douillard et al. 2025) with 1-bit,
error-feedback pseudo-gradients.

Each rank trains alone for H steps with any torch optimizer (the inner one, e.g. AdamW), then
the ranks average how far they moved and take one outer step together. With world size n,
rank r's parameters w_r, the synced (global) parameters theta (fp32, identical on every rank)
and local step s = t - start_iter:

    every step:        w_r <- inner step from w_r on rank r's own gradient (no communication)
    after step s, for each fragment f with s % H == offset_f (see below):
        pseudo-gradient      d_r = theta_f - w_r,f                         (fp32)
        mean                 D   = compressed_allreduce(d_r, e_f)           (1 bit, error feedback
                                   e_f: one ErrorFeedback per bucket; with compress=False the
                                   exact mean, fp32 sums in rank order;
                                   with rotate=True: D = R^T compressed_allreduce(R d_r, e_f),
                                   R a fixed orthogonal map per bucket, see `rotation`)
    after step s + overlap (the same step when overlap = 0):
        outer step           m_f <- mu m_f + D   (m_f <- D at the first)   torch.optim.SGD with
                             theta_f <- theta_f - lr_out (D + mu m_f)       momentum mu, Nesterov
                                        (or theta_f - lr_out m_f without Nesterov)
        mix                  w_r,f <- theta_f + (w_r,f - w_r,f at sending)

The mix keeps, on top of the new synced parameters, the inner steps a rank took while the
fragment's collective ran; with overlap = 0 it is w_r,f <- theta_f, bitwise the same on every
rank, as in DiLoCo. D is bitwise the same on every rank (the collective's guarantee) and the
outer SGD state starts equal, so theta stays bitwise identical everywhere.

Fragments (Streaming DiLoCo): the communication buckets are cut into K = `fragments` contiguous
runs of about equal size; fragment f syncs when s % H == offset_f = ((f + 1) H // K) mod H, so
each step sends at most one fragment and the peak traffic per step falls K-fold. Its collective
is started asynchronously on compcomm's ordered lane (the caller's own collectives are never
paired with it) and overlaps the next `overlap` inner steps (default 0 for K = 1, 1 otherwise;
at most H - 1, so that a fragment lands before it is sent again). The step it lands at is fixed,
not whenever the bytes arrive, so runs are reproducible and checkpoints resume exactly.

What travels: nothing during inner steps (but see GradScaler below); per sync of a fragment of N
elements in buckets padded to M, about 2 (n-1)/n * M/8 bytes per rank plus a few scalars per
bucket (compress=True; times `passes` for the syncs that take several 1-bit calls, see
`OuterSync._in_passes`), or 2 (n-1)/n * 4N (compress=False). Over H steps: the model once, against
H times for data-parallel training: H x 32 fewer bytes than fp32 DDP with compression.

Warm-up (`start_iter`, default 0): the first start_iter steps are plain data-parallel steps (the
gradients averaged exactly, fp32 sums in rank order, then the inner step on every rank alike);
theta is taken from the parameters at its end.

Memory beyond the inner optimizer: theta, the outer momentum, the communication buckets and
the worker error, each the model's size in fp32, plus the server error (1/n of it), and with
overlap > 0 a copy of each fragment in flight; with passes > 1 or rotate=True, the buckets'
spare errors (kept once used: a second worker and server error); with passes > 1, during such a
sync, one zero input per bucket of the fragment; with rotate=True, a byte per element (the
rotation's signs).
"""

from __future__ import annotations

import copy
import inspect
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch

from .. import schedules
from ..agreement import raise_agreed
from ..allreduce import compressed_allreduce_coalesced
from ..backends import Backend
from ..backends.registry import resolve_for_call
from ..error_feedback import ErrorFeedback
from ..errors import NonFiniteError
from ..gather_objects import agree_on_values
from ..layout import DEFAULT_BUCKET_BYTES, bucket_groups
from ..loss_scale import check_grad_scaler
from . import checkpoints, diloco_checkpoints
from .base import OnebitOptimizer
from .buckets import BucketLayout
from .diloco_checkpoints import check_outer
from .fragments import FragmentSchedule
from .outer import EXACT_BYTES, InFlight, OuterSync
from .replicas import check_plain_replicas, equalize_from_rank0, refuse_ddp_wrapped
from .scaler import BackwardAgreement, unscale_and_check
from .updates import check_count

PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_SCHEDULE = ("sync_every", "fragments", "overlap_steps", "start_iter", "compress", "passes", "passes_until", "rotate")
_SCHEDULE_DEFAULTS = {"passes": 1, "passes_until": None, "rotate": False}
"""What a checkpoint saved before `passes` or `rotate` existed ran with."""


class DiLoCo(torch.optim.Optimizer):
    """DiLoCo over the ranks of `backend`, stepping `inner` on each rank's own gradients and
    syncing every `sync_every` steps (the math: `compcomm.optim.diloco`'s module docstring).

    `params` are the parameters `inner` optimizes (the same set; not wrapped in DDP, not
    sharded); those with requires_grad=False when it is built are left out of the syncs and
    never changed by them (as DDP leaves them out of its buckets), the same ones on every rank.
    `inner.step()` must need no closure. `outer_lr`, `outer_momentum` and `nesterov` configure
    the outer torch.optim.SGD (`opt.outer`); `compress` picks the 1-bit error-feedback mean
    (True) or the exact one; `fragments` > 1 is Streaming DiLoCo, overlapping each fragment's
    collective with `overlap_steps` inner steps. `bucket_bytes` sizes the communication buckets: by default
    25 MiB, like DDP, or smaller where a model makes fewer than `fragments` such buckets (a
    fragment holds whole buckets, a bucket whole parameters; see `_bucket_bytes`).

    `passes` > 1 (with compress=True) sends each sync's pseudo-gradient in that many 1-bit calls
    with the same error feedback, the later ones carrying the errors the earlier left (about
    `passes` bits per element, `passes` times the bytes); `passes_until` limits that to the
    syncs sent up to that `step_count` (None: every sync), after which syncs take one call. The
    early syncs, whose pseudo-gradients are the largest, are where the 1-bit error costs most.
    `rotate=True` (with compress=True) rotates each bucket's pseudo-gradient by a fixed
    orthogonal transform before its 1-bit calls and the mean back before the outer step
    (`compcomm.optim.rotation`): one scale per chunk then fits every element, so each call
    carries more of the mean, at no extra bytes (the error feedback lives in the rotated
    coordinates and is kept only once the mean, rotated back, is finite; a second worker and
    server error (the spares), a byte per element for the rotation's signs, a half-window
    temporary and O(m log m) flops per bucket per sync).

    Built collectively: every rank constructs it together, and ranks whose parameters differ
    get rank 0's (with a warning). theta is taken from the parameters then (and at the end of
    the warm-up): weights loaded into the model later count as inner progress, pulled back
    towards theta at the first sync, so load them first (or load DiLoCo's state, which holds
    theta). A param group added to `inner` later is refused at the next `step()`.
    `param_groups` are the inner optimizer's, so an LR scheduler on either object schedules the
    inner learning rate. Every call to `step()` counts towards the sync schedule, a skipped
    inner step too, so that every rank syncs at the same calls.

    Non-finite values: a rank whose gradients hold NaN/Inf skips its inner step (between syncs
    the ranks are independent, so no other rank needs to know; `skipped_steps` counts this
    rank's), except at the very first backward, which is agreed as below because whether a
    GradScaler is in use is not known yet: a non-finite gradient on any rank there puts a NaN
    into one gradient element of every other rank, and every rank skips its first inner step.
    That agreement is a collective at the end of each rank's first backward, or at its first
    `step()` where that comes first (a rank with no batch yet), so a rank runs its own
    collectives after it in step with the others.
    With torch.amp.GradScaler (`scaler.step(opt)`), the ranks agree at the end of every
    backward, every rank skips alike and the scales stay equal; that agreement is one 8-byte
    all-reduce per backward, which waits behind a fragment still in flight, so the ranks then
    run the same number of backward passes. Pass the scaler as `grad_scaler`: DiLoCo then
    agrees from the start, where it would otherwise learn of it at the first `scaler.step`, too
    late for a backward before it other than the run's first (a later micro-batch of the first
    step, a scaler switched on after steps without one, a resume from a state saved without
    one), whose verdicts, if they differ, are a ValueError on every rank at that step. A sync whose
    pseudo-gradient is non-finite on any rank, or whose mean would overflow fp32 or take the
    outer step beyond it (the collective's bound against `OuterSync.step_limit`, from theta's
    and the momentum's largest magnitudes and the outer SGD's settings), is skipped on every
    rank: theta, the outer momentum and the error feedback are unchanged, and the fragment's
    parameters return to theta everywhere (`skipped_syncs` counts them; the first warns).

    Checkpoints: `state_dict()` holds theta, the outer momentum, this rank's error feedback,
    inner state and parameters (they differ across ranks between syncs), the step count and the
    fragments in flight, whose collectives it waits for (without applying them: they still land
    at their step, so saving changes nothing). `gathered_state_dict()` is one file for all
    ranks. `load_state_dict` is collective; another rank's, layout's, world size's or schedule's
    state raises the same ValueError on every rank.
    """

    _step_supports_amp_scaling = True  # torch.amp.GradScaler hands us grad_scale / found_inf

    def __init__(
        self,
        params: Iterable,
        inner: torch.optim.Optimizer,
        sync_every: int = 50,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        nesterov: bool = True,
        compress: bool = True,
        fragments: int = 1,
        backend: Backend | str | None = None,
        *,
        start_iter: int = 0,
        overlap_steps: int | None = None,
        bucket_bytes: int | None = None,
        passes: int = 1,
        passes_until: int | None = None,
        rotate: bool = False,
        grad_scaler: torch.amp.GradScaler | None = None,
    ) -> None:
        try:
            super().__init__(params, {})
            no_params = None
        except (TypeError, ValueError) as exc:  # e.g. an empty list on this rank alone: raised below, everywhere
            no_params = exc
        mine = [p for group in getattr(self, "param_groups", ()) for p in group["params"]]
        trained = [i for i, p in enumerate(mine) if p.requires_grad]  # the synced: frozen ones stay as they are
        be, failure = resolve_for_call(backend, mine[0] if mine else None)
        try:  # a bad argument on one rank is raised on every rank, not left to hang the others
            if no_params is not None:
                raise no_params
            overlap = _checked_arguments(
                inner, mine, sync_every, fragments, start_iter, bucket_bytes, passes, passes_until, overlap_steps
            )
            if bucket_bytes is None:
                bucket_bytes = _bucket_bytes([mine[i] for i in trained], fragments)
            check_outer(outer_lr, outer_momentum, nesterov)
            for name, flag in (("compress", compress), ("rotate", rotate)):
                if not isinstance(flag, bool):
                    raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
            if passes > 1 and not compress:
                raise ValueError(f"passes={passes} needs compress=True: an exact sync is exact in one call")
            if rotate and not compress:
                raise ValueError("rotate=True needs compress=True: it serves the 1-bit code; an exact mean needs none")
            check_grad_scaler(grad_scaler)
        except (TypeError, ValueError) as exc:
            failure = failure or exc
        raise_agreed(failure, be)
        outer = dict(lr=float(outer_lr), momentum=float(outer_momentum), nesterov=nesterov)
        agree_on_values(
            dict(
                sync_every=sync_every,
                fragments=fragments,
                overlap_steps=overlap,
                start_iter=start_iter,
                compress=compress,
                bucket_bytes=bucket_bytes,
                passes=passes,
                passes_until=passes_until,
                rotate=rotate,
                grad_scaler=grad_scaler is not None,
                **outer,
                requires_grad=[p.requires_grad for p in mine],
            ),
            be,
            "DiLoCo's schedule, outer step and synced parameters (those with requires_grad) must be the "
            "same on every rank (else its syncs pair collectives of different steps and theta parts)",
        )
        self.defaults = inner.defaults
        self.inner = inner
        del self.__dict__["_own_groups"]  # from now on `param_groups` reads inner's
        self._params = mine
        self._inner_count = sum(len(group["params"]) for group in inner.param_groups)  # see _check_inner_unchanged
        self._frozen = [p for p in mine if not p.requires_grad]
        self._unfrozen_warned = False
        self.sync_every, self.fragments, self.overlap_steps = int(sync_every), int(fragments), overlap
        self.start_iter, self.compress = int(start_iter), compress
        self.passes, self.passes_until = int(passes), None if passes_until is None else int(passes_until)
        self.rotate = rotate
        self._backend = be
        equalize_from_rank0(mine, be)
        assert bucket_bytes is not None  # else raised on every rank
        layout = BucketLayout(mine, trained, bucket_bytes, be.world_size, "DiLoCo")
        schedule = FragmentSchedule(layout.sizes(), fragments, sync_every, overlap)
        self._sync = OuterSync(mine, layout, schedule, outer, compress, be, rotate)
        with torch.no_grad():
            self._sync.reset_from_params()
        self._agreement = BackwardAgreement(mine, lambda: self._backend, given=grad_scaler is not None)
        self._step_count = 0
        self.skipped_steps = 0
        self.skipped_syncs = 0
        self.last_step_skipped = False

    # ----------------------------------------------------------------- what it exposes

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "inner", None) is not None:
            raise RuntimeError("DiLoCo syncs a fixed set of parameters: add every group before building it")
        super().add_param_group(param_group)

    @property
    def backend(self) -> Backend:
        return self._backend

    @property
    def outer(self) -> torch.optim.SGD:
        """The outer optimizer (torch.optim.SGD over theta's fp32 buckets)."""
        return self._sync.outer

    @property
    def step_count(self) -> int:
        """Calls to `step()` so far (skipped inner steps count: they keep the sync schedule)."""
        return self._step_count

    @property
    def error_feedback(self) -> list[ErrorFeedback]:
        """Each communication bucket's error feedback (this rank's), in bucket order. Reading it
        waits for the fragments in flight, whose collectives write their buckets' errors (they
        still land at their own step, as after `state_dict()`): read it while one is in flight,
        e.g. after every step, and that fragment's collective no longer overlaps the inner
        steps. Read it after a fragment lands to keep the overlap."""
        self._sync.wait_all()
        return self._sync.layout.error_feedback

    def global_parameters(self) -> list[torch.Tensor]:
        """The synced parameters theta (fp32 views, identical on every rank), one per parameter in
        parameter order: what to evaluate or save as the shared model. Treat them as read-only.
        A parameter frozen when DiLoCo was built is not synced: its entry is the parameter itself."""
        return self._sync.global_parameters()

    # ----------------------------------------------------------------- the step

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One inner step on this rank's gradients, then the syncs the schedule puts after it
        (collective: every rank calls it together). Returns the closure's loss, if given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        self._check_inner_unchanged()
        t = self._step_count + 1
        if t == 1:  # a DDP wrapper made after DiLoCo was built. Its constructor is collective, so
            # every rank has one and raises alike, with no message of DiLoCo's own at step 1.
            refuse_ddp_wrapped(self._params, "DiLoCo", since_built=True)
        self._agreement.at_step()
        try:
            found = None if found_inf is None else self._agreement.scaler_verdict(bool(float(found_inf)))
        except ValueError:  # the scaler deletes what it set on the optimizer only after a step that returns
            self.__dict__.pop("grad_scale", None)
            self.__dict__.pop("found_inf", None)
            raise
        skip = unscale_and_check(self._params, scale) or bool(found)
        if not self._unfrozen_warned and any(p.grad is not None for p in self._frozen):
            self._unfrozen_warned = True
            warnings.warn(
                "DiLoCo: a parameter frozen (requires_grad=False) when DiLoCo was built has a gradient now: the "
                "inner optimizer trains it on each rank alone and it is never synced, so the ranks' copies drift "
                "apart. Set requires_grad before building DiLoCo.",
                RuntimeWarning,
                stacklevel=2,
            )
        self._agreement.agreed = False
        if t <= self.start_iter:
            skip = not self._average_gradients(skip)
        if skip:
            self._skip_step()
        else:
            self.inner.step()
            self.last_step_skipped = False
        self._step_count = t
        s = t - self.start_iter
        if s == 0:  # the end of the warm-up: every rank holds the same parameters
            self._sync.reset_from_params()
        for entry in self._sync.due(s):
            self._land(entry)
        for f in self._sync.schedule.sending(s):
            entry = self._sync.send(f, s, self._passes_now())
            if entry.apply_at <= s:
                self._land(entry)
        return loss

    def _check_inner_unchanged(self) -> None:
        """ValueError (before anything changes) if `inner` now holds more or fewer parameters
        than when DiLoCo was built: a group added to it since would train on each rank alone and
        never be synced. Counted, not compared one by one, to cost nothing per step. Every rank
        of an SPMD program adds a group at the same step, so every rank raises there."""
        held = sum(len(group["params"]) for group in self.inner.param_groups)
        if held != self._inner_count:
            raise ValueError(
                f"DiLoCo: the inner optimizer now holds {held} parameters where it held {self._inner_count} when "
                "DiLoCo was built (a param group added to it since?): DiLoCo syncs a fixed set, and the "
                "others would train on each rank alone and never be synced. Add every group to the inner "
                "optimizer before building DiLoCo."
            )

    def sync(self) -> None:
        """Sync now every fragment that took inner steps since it was last sent (collective):
        apply the fragments in flight, then send those and apply their outer steps at once.
        Every rank then holds theta, bitwise the same: for the end of training, or before using
        the model as the shared one. The schedule goes on from the next step as before. In the
        warm-up, where the ranks are in step anyway, theta is taken from the parameters."""
        s = self._step_count - self.start_iter
        with torch.no_grad():
            if s <= 0:
                self._sync.reset_from_params()
                return
            for entry in self._sync.due():
                self._land(entry)
            for f, sent_at in enumerate(self._sync.sent_at):
                if sent_at != s:
                    self._land(self._sync.send(f, s, self._passes_now()))

    def _passes_now(self) -> int:
        """1-bit calls for a sync sent after the current step (see `passes`)."""
        if self.passes_until is None or self._step_count <= self.passes_until:
            return self.passes
        return 1

    def _average_gradients(self, skip: bool) -> bool:
        """A warm-up step's exact gradient average, written back into `.grad` (absent gradients
        count as zeros). A rank that must skip sends NaN, so that the collective fails on every
        rank alike: returns False then, with no gradient changed."""
        layout = self._sync.layout
        for b, bucket in enumerate(layout.buckets):
            for view, i in zip(bucket.views, layout.parameters_of(b)):
                g = self._params[i].grad
                if g is None:
                    view.zero_()
                else:
                    view.copy_(g)
        if skip:
            layout.buckets[0].flat[0] = float("nan")
        try:
            compressed_allreduce_coalesced(
                [b.flat for b in layout.buckets],
                layout.error_feedback,
                backend=self._backend,
                op="mean",
                min_compress_bytes=EXACT_BYTES,
            )
        except NonFiniteError:
            return False
        for b, bucket in enumerate(layout.buckets):
            for view, i in zip(bucket.views, layout.parameters_of(b)):
                p = self._params[i]
                if p.grad is None:
                    p.grad = torch.empty_like(p)
                p.grad.copy_(view.view_as(p))
        return True

    def _skip_step(self) -> None:
        self.last_step_skipped = True
        self.skipped_steps += 1
        if self.skipped_steps == 1:
            warnings.warn(
                "DiLoCo: inner step skipped (non-finite gradients); the step still counts towards "
                "the sync schedule. Further skips are counted in `skipped_steps` without warning again.",
                RuntimeWarning,
                stacklevel=3,
            )

    def _land(self, entry: InFlight) -> None:
        if self._sync.land(entry):
            return
        self.skipped_syncs += 1
        if self.skipped_syncs == 1:
            warnings.warn(
                f"DiLoCo: sync of fragment {entry.fragment} skipped on every rank ({entry.failure}); the "
                "synced parameters, outer momentum and error feedback are unchanged and the fragment's "
                "parameters were reset to them. Further skips are counted in `skipped_syncs`.",
                RuntimeWarning,
                stacklevel=3,
            )

    # ----------------------------------------------------------------- checkpoints

    def _schedule(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _SCHEDULE}

    def state_dict(self) -> dict[str, Any]:
        """theta, the outer SGD's state, and under "compcomm" this rank's part (error feedback,
        inner optimizer state, parameters, fragments in flight, whose collectives are waited
        for here but applied at their own step). Save it on every rank, or use
        `gathered_state_dict()` for one file that serves all ranks."""
        sync = self._sync
        rank_local = {
            "inner": self.inner.state_dict(),
            "params": [p.detach().clone() for p in self._params],
            "in_flight": sync.in_flight_state(),
            "skipped_steps": self.skipped_steps,
            "last_step_skipped": self.last_step_skipped,
            "backward_agreement": self._agreement.state_dict(),
        }
        extra = checkpoints.compcomm_entry(
            type(self).__name__,
            self._step_count,
            self._backend,
            sync.layout,
            {"skipped_syncs": self.skipped_syncs, "sent_at": list(sync.sent_at)},
            rank_local,
        )
        return {
            "schedule": self._schedule(),
            "synced": [t.clone() for t in sync.theta],
            "outer": sync.outer.state_dict(),
            checkpoints.EXTRA_KEY: extra,
        }

    def gathered_state_dict(self) -> dict[str, Any]:
        """A state dict for all ranks at once (collective: call it on every rank, save it from
        one); `load_state_dict` on each rank picks its own part. It holds every rank's inner
        state and parameters, so it is about world_size times a per-rank file."""
        return checkpoints.gathered(self.state_dict(), self._backend)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The inner optimizer's groups, read through on every access: an LR scheduler on this
        object schedules the inner learning rate, also after `load_state_dict` (torch's
        `Optimizer.load_state_dict` gives the inner optimizer new group dicts; a list taken once
        would leave the scheduler editing the old ones)."""
        inner = self.__dict__.get("inner")
        if inner is not None:
            return inner.param_groups
        own = self.__dict__.get("_own_groups")  # during __init__; after a bare unpickle, torch's
        return own if own is not None else self.__dict__.get("param_groups", [])

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        """torch.optim.Optimizer.__init__ sets the groups before the inner optimizer is known."""
        inner = self.__dict__.get("inner")
        if inner is None:
            self.__dict__["_own_groups"] = groups
        else:
            inner.param_groups = groups

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume from `state_dict()` or `gathered_state_dict()`, bit for bit (collective). A state
        of another rank (e.g. rank 0's per-rank file loaded everywhere), world size, layout or
        schedule raises ValueError on every rank, with nothing loaded."""
        sync, be = self._sync, self._backend
        held = [opt.state_dict() for opt in (sync.outer, self.inner)]  # a load replaces, never writes, them
        try:  # whatever this rank finds wrong is raised on every rank, before anything else loads
            mine, problem = self._own_part(state_dict)
            if problem is None:  # torch's own checks of the two optimizers' states, tried here
                sync.outer.load_state_dict(copy.deepcopy(state_dict["outer"]))
                self.inner.load_state_dict(copy.deepcopy(mine["rank_local"]["inner"]))
                position = diloco_checkpoints.position(state_dict, mine)
        except Exception as exc:  # refused on every rank below
            problem = checkpoints.unreadable("DiLoCo", exc)
        try:
            raise_agreed(None if problem is None else ValueError(problem), be)
            checkpoints.agree_on_position(position, be)
        except BaseException:
            for opt, state in zip((sync.outer, self.inner), held):
                opt.load_state_dict(state)
            raise
        extra = state_dict[checkpoints.EXTRA_KEY]
        sync.drop_all()
        local = mine["rank_local"]
        with torch.no_grad():
            for theta, saved in zip(sync.theta, state_dict["synced"]):
                theta.copy_(saved)
            for p, saved in zip(self._params, local["params"]):
                p.detach().copy_(saved)
        for ef, saved in zip(sync.layout.error_feedback, mine["error_feedback"]):
            ef.load_state_dict(saved)
        sync.load_in_flight(local["in_flight"])
        self._step_count = int(extra["step"])
        self.skipped_syncs = int(extra["scalars"]["skipped_syncs"])
        sync.sent_at = list(extra["scalars"]["sent_at"])
        self.skipped_steps = int(local["skipped_steps"])
        self.last_step_skipped = bool(local.get("last_step_skipped", False))
        # a state saved before these were kept: a run that stepped had had its first backward
        self._agreement.load_state_dict(
            local.get("backward_agreement", {"first_done": self._step_count > 0, "scaler_seen": False})
        )

    def _own_part(self, state_dict: Any) -> tuple[dict[str, Any], str | None]:
        """This rank's part of `state_dict`, and why it cannot be loaded here (None if it can)."""
        extra = state_dict.get(checkpoints.EXTRA_KEY) if isinstance(state_dict, dict) else None
        if extra is None or "synced" not in state_dict or "schedule" not in state_dict:
            return {}, "not a DiLoCo state dict (no 'compcomm', 'synced' or 'schedule' entry)"
        if {**_SCHEDULE_DEFAULTS, **state_dict["schedule"]} != self._schedule():
            return {}, f"the checkpoint's schedule {state_dict['schedule']} is not this optimizer's {self._schedule()}"
        saved_world = extra.get("world_size")
        if saved_world != self._backend.world_size:
            return {}, (
                f"this checkpoint was saved on {saved_world} ranks and cannot resume on "
                f"{self._backend.world_size}: its error feedback, inner optimizer state and "
                "parameters belong to each of those ranks"
            )
        mine, problem = checkpoints.own_part(
            extra,
            self._backend,
            self._sync.layout,
            "different parameters, bucket_bytes, or parameters frozen otherwise (those with "
            "requires_grad=False at construction are not synced)",
        )
        if problem is not None:
            return mine, problem
        saved_groups = mine["rank_local"]["inner"]["param_groups"]
        if [len(g["params"]) for g in saved_groups] != [len(g["params"]) for g in self.inner.param_groups]:
            return mine, "the checkpoint's inner optimizer has other parameter groups than this one's"
        problem = diloco_checkpoints.problem(state_dict, mine, self._sync, self.start_iter)
        if problem is not None:
            return mine, problem
        served = [schedules.serves(self._backend)(numel) for numel in self._sync.layout.sizes()]
        return mine, checkpoints.error_feedback_problem(
            mine["error_feedback"], served, "Load it into a DiLoCo over the backend it was saved with"
        )


def _checked_arguments(
    inner: Any,
    params: list[torch.Tensor],
    sync_every: int,
    fragments: int,
    start_iter: int,
    bucket_bytes: int | None,
    passes: int,
    passes_until: int | None,
    overlap_steps: int | None,
) -> int:
    """This rank's checks of DiLoCo's inner optimizer, parameters and schedule (TypeError or
    ValueError); returns the steps a fragment's sync overlaps."""
    if not isinstance(inner, torch.optim.Optimizer):
        raise TypeError(f"inner must be a torch.optim.Optimizer, got {type(inner).__name__}")
    if isinstance(inner, (OnebitOptimizer, DiLoCo)):
        raise ValueError(
            f"inner must step on this rank's own gradients; {type(inner).__name__} communicates "
            "itself: use a torch optimizer (e.g. torch.optim.AdamW)"
        )
    check_count("sync_every", sync_every, 1)
    check_count("fragments", fragments, 1)
    check_count("start_iter", start_iter, 0)
    if bucket_bytes is not None:
        check_count("bucket_bytes", bucket_bytes, 1)
    check_count("passes", passes, 1)
    if passes_until is not None:
        check_count("passes_until", passes_until, 0)
    if fragments > sync_every:
        raise ValueError(f"fragments={fragments} must be at most sync_every={sync_every} (one sync per step)")
    overlap = (0 if fragments == 1 else 1) if overlap_steps is None else overlap_steps
    check_count("overlap_steps", overlap, 0)
    if overlap >= sync_every:
        raise ValueError(
            f"overlap_steps={overlap} must be below sync_every={sync_every}: a fragment must land "
            "before it is sent again"
        )
    closure = inspect.signature(inner.step).parameters.get("closure")
    if closure is not None and closure.default is inspect.Parameter.empty:
        raise TypeError(
            f"inner {type(inner).__name__} needs a closure in step() (it evaluates the loss again itself); "
            "DiLoCo steps its inner optimizer without one: use one whose step() takes none (e.g. AdamW)"
        )
    theirs = [p for group in inner.param_groups for p in group["params"]]
    if {id(p) for p in params} != {id(p) for p in theirs} or len(params) != len({id(p) for p in params}):
        raise ValueError(
            "params must be exactly the parameters that inner optimizes (each once): "
            f"got {len(params)} here and {len(theirs)} in inner"
        )
    if not any(p.requires_grad for p in params):
        raise ValueError("no parameter requires_grad: DiLoCo syncs those that do (set it before building DiLoCo)")
    for p in params:
        if p.dtype not in PARAM_DTYPES:
            raise ValueError(f"parameters must be float32, bfloat16 or float16, got {p.dtype}")
    check_plain_replicas(params, "DiLoCo")
    return int(overlap)


def _bucket_bytes(params: list[torch.Tensor], fragments: int) -> int:
    """The buckets' size when none is given: 25 MiB, or for a model that makes fewer than
    `fragments` buckets of that size (one under `fragments` x 25 MiB), an even share of it,
    halved until the buckets are enough (at worst one per parameter, since a bucket holds whole
    parameters: ValueError for fewer parameters than fragments)."""
    if fragments == 1:
        return DEFAULT_BUCKET_BYTES
    share = -(-sum(p.numel() for p in params) * 4 // fragments)
    size = max(1, min(DEFAULT_BUCKET_BYTES, share))
    buckets = len(bucket_groups(params, size, torch.float32))
    while size > 1 and buckets < fragments:
        size //= 2
        buckets = len(bucket_groups(params, size, torch.float32))
    if buckets < fragments:
        raise ValueError(
            f"fragments={fragments} needs at least as many communication buckets, and a bucket holds whole "
            f"parameters: these make at most {buckets}; lower fragments"
        )
    return size

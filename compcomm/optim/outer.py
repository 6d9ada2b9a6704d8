"""DiLoCo's outer loop: the synced parameters, the pseudo-gradient collectives, the outer step.

The synced (global) parameters theta live in fp32 buffers shaped like the communication buckets,
identical on every rank. Sending fragment f: every rank writes its pseudo-gradient
theta_f - w_f (w_f: its own parameters, fp32) into the fragment's buckets and starts one
coalesced collective over them (`compressed_allreduce_coalesced`, one ErrorFeedback per bucket;
exact when not compressing), which runs on the backend's ordered lane while the caller goes on;
with `rotate`, each bucket is rotated first (`rotation.rotate_`) and its mean rotated back once
it has arrived, before the error feedback is kept.
Landing it: wait for the mean D, take the outer step, a torch.optim.SGD step on theta_f with D
as its gradient, and move the fragment's parameters (see `OuterSync.land`). A collective that
raises NonFiniteError (some rank's pseudo-gradient is not finite, the mean would overflow, or
the outer step of it could: see `step_limit`) raised it on every rank with nothing changed; the
sync is then skipped on every rank.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..agreement import CallSpec
from ..allreduce import allreduce_call, compressed_allreduce_coalesced
from ..backends import Backend
from ..backends.ordering import Pending
from ..errors import NonFiniteError, largest_magnitude
from ..layout import unflatten
from .buckets import BucketLayout
from .fragments import FragmentSchedule
from .rotation import rotate_, signs, unrotate_

_TOP = float(torch.finfo(torch.float32).max) * (1.0 - 2.0**-10)  # fp32's top, less its rounding margin

EXACT_BYTES = sys.maxsize
"""`min_compress_bytes` of an exact sync: every bucket goes through the collective's exact path
(fp32 sums in rank order, bitwise the same on every rank and backend, the same agreement)."""


@dataclass
class InFlight:
    """A fragment sent and not yet applied."""

    fragment: int
    apply_at: int  # the local step after which it is applied
    handle: Pending | None  # None once the collective has completed (the mean is in the buckets)
    sent: list[torch.Tensor] | None  # this rank's fp32 parameters when sent, per bucket (None: overlap 0)
    failure: NonFiniteError | None = None


class OuterSync:
    """theta, the outer SGD over it, and the fragments in flight, for `params` laid out in `layout`."""

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        layout: BucketLayout,
        schedule: FragmentSchedule,
        outer: dict[str, Any],
        compress: bool,
        backend: Backend,
        rotate: bool = False,
    ) -> None:
        self.params, self.layout, self.schedule, self.backend = list(params), layout, schedule, backend
        self.compress = compress
        self.signs = [signs(b.numel, b.buffer.device) for b in layout.buckets] if rotate else None
        self.theta = [torch.zeros(b.numel, dtype=torch.float32, device=b.buffer.device) for b in layout.buckets]
        self.theta_views = [unflatten(t, [v.shape for v in b.views]) for t, b in zip(self.theta, layout.buckets)]
        self.outer = torch.optim.SGD(self.theta, **outer)
        self.in_flight: dict[int, InFlight] = {}
        self.sent_at: list[int | None] = [None] * len(schedule)  # each fragment's last local step sent

    # ----------------------------------------------------------------- per-bucket views

    def _entries(self, b: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """(parameter, its theta view, its slot in the communication bucket) of bucket b."""
        bucket = self.layout.buckets[b]
        params = [self.params[i] for i in self.layout.parameters_of(b)]
        return list(zip(params, self.theta_views[b], bucket.views))

    def reset_from_params(self) -> None:
        """theta <- the parameters (once they are equal on every rank)."""
        for b in range(len(self.layout)):
            for p, theta, _ in self._entries(b):
                theta.copy_(p.detach())

    def global_parameters(self) -> list[torch.Tensor]:
        """theta's view of each parameter, in parameter order (a parameter outside the buckets,
        frozen when DiLoCo was built: itself, never changed by the syncs)."""
        out = [p.detach() for p in self.params]
        for b in range(len(self.layout)):
            for i, view in zip(self.layout.parameters_of(b), self.theta_views[b]):
                out[i] = view
        return out

    # ----------------------------------------------------------------- send and land

    def send(self, f: int, s: int, passes: int = 1) -> InFlight:
        """Start fragment f's collective of this rank's pseudo-gradient after local step s, in
        `passes` 1-bit calls, rotated where `signs` are set (see `_in_passes`)."""
        buckets = self.schedule.buckets[f]
        sent = None
        if self.schedule.overlap:
            sent = [torch.empty_like(self.theta[b]) for b in buckets]
        for k, b in enumerate(buckets):
            keep = None if sent is None else unflatten(sent[k], [v.shape for v in self.theta_views[b]])
            for j, (p, theta, slot) in enumerate(self._entries(b)):
                source = p.detach()
                if keep is not None:
                    source = keep[j].copy_(source)
                torch.sub(theta, source, out=slot)
        handle = self.backend.ordered(self._reduce, list(buckets), passes, async_op=True)
        assert isinstance(handle, Pending)
        self.sent_at[f] = s
        entry = self.in_flight[f] = InFlight(f, s + self.schedule.overlap, handle, sent)
        return entry

    def _reduce(self, buckets: list[int], passes: int) -> list[torch.Tensor]:
        """The buckets' mean pseudo-gradient, on the ordered lane: one call where a single plain
        pass does, else `_in_passes`; each bucket's mean limited to what its outer step takes
        (`step_limit`, read here, off the caller's steps: theta and the momentum only change
        when this sync lands)."""
        limits = [self.step_limit(b) for b in buckets]
        if passes > 1 or self.signs is not None:
            return self._in_passes(buckets, passes, limits)
        spec = CallSpec(
            [self.layout.buckets[b].flat for b in buckets],
            [self.layout.error_feedback[b] for b in buckets],
            min_compress_bytes=None if self.compress else EXACT_BYTES,
            limits=limits,
        )
        result = allreduce_call(spec, self.backend)
        assert isinstance(result, list)
        return result

    def step_limit(self, b: int) -> float:
        """The largest |D| that the outer step of bucket b takes with every value it computes
        inside fp32, from theta's and the momentum's largest magnitudes T and M (bitwise equal
        on every rank, and unchanged until the bucket's sync lands): with torch.optim.SGD's
        lr, momentum mu, dampening and weight decay wd, each of

            g0 = D + wd theta              <= |D| + wd T
            m' = mu m + (1 - dampening) g0 <= mu M + k g0    (k = max(1, |1 - dampening|))
            g  = g0 + mu m' (Nesterov), m' (momentum), g0 (none)
            theta - lr g                   <= T + lr |g|

        grows linearly in |D|, and the limit keeps all of them below fp32's top. A mean beyond
        it is refused like an overflow, so a finite theta never becomes inf."""
        theta = self.theta[b]
        group = next(g for g in self.outer.param_groups if any(p is theta for p in g["params"]))
        lr, mu, wd = float(group["lr"]), float(group["momentum"]), float(group["weight_decay"])
        top_theta = largest_magnitude(theta)
        momentum = self.outer.state.get(theta, {}).get("momentum_buffer")
        top_momentum = 0.0 if momentum is None else largest_magnitude(momentum)
        g0 = (1.0, abs(wd) * top_theta)  # (a, c): the bound a |D| + c
        forms = [g0]
        if mu != 0.0:
            kept = max(1.0, abs(1.0 - float(group["dampening"])))
            m = (kept * g0[0], abs(mu) * top_momentum + kept * g0[1])
            g = (g0[0] + abs(mu) * m[0], g0[1] + abs(mu) * m[1]) if group["nesterov"] else m
            forms += [m, g]
        else:
            g = g0
        forms.append((abs(lr) * g[0], top_theta + abs(lr) * g[1]))
        return max(0.0, min((_TOP - c) / a if a > 0 else math.inf for a, c in forms))

    def _in_passes(self, buckets: list[int], passes: int, limits: list[float]) -> list[torch.Tensor]:
        """The 1-bit mean of the buckets' pseudo-gradients in `passes` calls carrying one error
        feedback along: the first reduces the pseudo-gradients, each later one a zero input, i.e.
        the worker and server errors the calls before it left, and the means are summed in call
        order:

            D = CA(d) + CA(0) + ... + CA(0)     (about `passes` bits per element, `passes` x the bytes)

        By the identity of the error feedback, what D leaves out of the true mean is the error
        after the last call, which shrinks with every pass. The calls write their errors into the
        buckets' spares (`BucketLayout.keep`), which become the error feedback only when every
        call has passed: a call refused on every rank (non-finite pseudo-gradients, or a later
        pass whose errors would overflow) leaves the error feedback as it was, and the sync is
        skipped. Transient memory: the spares' errors and, with passes > 1, one zero input per
        bucket.

        Rotated (`signs` set, any number of passes), the calls reduce R d, and D is rotated back
        here. A D that is not finite once rotated back, or beyond its bucket's `limits` entry
        (`step_limit`: the same bytes and limits on every rank, so every rank finds it alike),
        raises NonFiniteError before the errors are kept, with the error feedback as it was.
        Both rotations run here, on the ordered lane, off the caller's steps."""
        layout = self.layout
        tensors = [layout.buckets[b].flat for b in buckets]
        if self.signs is not None:
            for b, t in zip(buckets, tensors):
                rotate_(t, self.signs[b])
        spares = [layout.spare[b] for b in buckets]
        compressed_allreduce_coalesced(
            tensors, [layout.error_feedback[b] for b in buckets], self.backend, "mean", error_feedbacks_out=spares
        )
        rests = [torch.empty_like(t) for t in tensors] if passes > 1 else []
        for _ in range(passes - 1):
            for rest in rests:
                rest.zero_()
            compressed_allreduce_coalesced(rests, spares, self.backend, "mean", error_feedbacks_out=spares)
            for t, rest in zip(tensors, rests):
                t.add_(rest)
        if self.signs is not None:
            for b, t in zip(buckets, tensors):
                unrotate_(t, self.signs[b])
        for t, limit in zip(tensors, limits):
            top = largest_magnitude(t)
            if not math.isfinite(top):
                raise NonFiniteError(
                    "the 1-bit mean (summed over its calls, rotated back) is not finite in float32: the sync is skipped"
                )
            if top >= limit:
                raise NonFiniteError(
                    f"the 1-bit mean reaches {top:.3e}, beyond the {limit:.3e} that the outer step takes without "
                    "overflowing float32: the sync is skipped"
                )
        for b, spare in zip(buckets, spares):
            layout.keep(b, spare)
        return tensors

    @staticmethod
    def wait(entry: InFlight) -> None:
        """Wait for the entry's collective (its mean then sits in the buckets, or it failed)."""
        if entry.handle is None:
            return
        try:
            entry.handle.wait()
        except NonFiniteError as exc:
            entry.failure = exc
        entry.handle = None

    def land(self, entry: InFlight) -> bool:
        """Apply fragment `entry.fragment`: with D the mean pseudo-gradient, theta_old its synced
        parameters, w this rank's parameters now and w_sent when it was sent,

            theta <- SGD step from theta_old with gradient D  (outer momentum, Nesterov)
            w     <- theta + (w - w_sent)                      (w <- theta when overlap is 0)

        so the inner steps taken while the collective ran are kept on top of the new synced
        parameters. Returns False when the collective failed on every rank: theta, the outer
        momentum and the error feedback are then as before, and w <- theta on every rank (the
        fragment's local progress since its last sync is dropped alike everywhere)."""
        self.wait(entry)
        del self.in_flight[entry.fragment]
        buckets = self.schedule.buckets[entry.fragment]
        if entry.failure is None:
            for b in buckets:
                self.theta[b].grad = self.layout.buckets[b].flat
            try:
                self.outer.step()
            finally:
                for b in buckets:
                    self.theta[b].grad = None
        for k, b in enumerate(buckets):
            kept = None
            if entry.sent is not None and entry.failure is None:
                kept = unflatten(entry.sent[k], [v.shape for v in self.theta_views[b]])
            for j, (p, theta, slot) in enumerate(self._entries(b)):
                if kept is None:
                    p.detach().copy_(theta)
                else:  # slot (the mean, already used) holds w - w_sent, then theta + that
                    torch.sub(p.detach(), kept[j], out=slot).add_(theta)
                    p.detach().copy_(slot)
        return entry.failure is None

    def due(self, s: int | None = None) -> list[InFlight]:
        """The fragments to apply after local step s (None: all in flight), in fragment order."""
        return sorted((e for e in self.in_flight.values() if s is None or e.apply_at <= s), key=lambda e: e.fragment)

    def wait_all(self) -> None:
        for entry in self.in_flight.values():
            self.wait(entry)

    def drop_all(self) -> None:
        """Forget the fragments in flight (after their collectives ended)."""
        self.wait_all()
        self.in_flight.clear()

    # ----------------------------------------------------------------- checkpoints

    def in_flight_state(self) -> list[dict[str, Any]]:
        """The fragments in flight, each with its landed mean (waited for here, not applied)
        and this rank's parameters when sent."""
        self.wait_all()
        out = []
        for f in sorted(self.in_flight):
            e = self.in_flight[f]
            mean = None if e.failure else [self.layout.buckets[b].flat.clone() for b in self.schedule.buckets[f]]
            out.append(
                {
                    "fragment": f,
                    "apply_at": e.apply_at,
                    "mean": mean,
                    "sent": None if e.sent is None else [t.clone() for t in e.sent],
                    "failure": None if e.failure is None else str(e.failure),
                }
            )
        return out

    def load_in_flight(self, saved: list[dict[str, Any]]) -> None:
        self.drop_all()
        for d in saved:
            f = int(d["fragment"])
            if d["mean"] is not None:
                for b, mean in zip(self.schedule.buckets[f], d["mean"]):
                    self.layout.buckets[b].flat.copy_(mean)
            sent = None if d["sent"] is None else [t.detach().clone().to(self.theta[0].device) for t in d["sent"]]
            failure = None if d["failure"] is None else NonFiniteError(d["failure"])
            self.in_flight[f] = InFlight(f, int(d["apply_at"]), None, sent, failure)

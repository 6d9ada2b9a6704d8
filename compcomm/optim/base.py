"""What the compressed optimizers share: buckets, overlap with backward, the step, checkpoints.

Each step t communicates one payload per parameter, chosen by the subclass:

    kind(t) = "exact"        payload averaged with the uncompressed all-reduce (e.g. gradients
                             in warm-up)
              "compressed"   payload averaged with the 1-bit `compressed_allreduce`, one
                             ErrorFeedback per bucket (e.g. momenta after the freeze)
              "local"        nothing is sent (0/1 Adam's local steps)

Payloads travel in fp32 `compcomm.layout.Bucketer` buckets: one collective per bucket. A
bucket's collective starts as soon as the last of its gradients is accumulated during
backward (a post-accumulate-grad hook), so communication overlaps the rest of backward;
buckets follow the order in which gradients became ready in the first backward (agreed
across ranks). `step()` agrees with the other ranks, in one tiny all-reduce, on whether every
gradient is finite (and on whether some rank changed its gradients after backward, in which
case every rank sends again), waits for what is in flight, then applies the update. Where a
non-finite gradient always makes the payload non-finite (`_payload_shows_nonfinite`), the
collective finds it on every rank alike and the rank's own scan of its gradients is skipped.

A step is all-or-nothing on every rank: if any rank's gradients (or a GradScaler's inf check)
are non-finite, or an average is non-finite (an fp32 overflow of finite inputs), every rank
skips the step. Each bucket's compressed allreduce writes the new errors into a spare error
feedback kept per bucket (`error_feedback_out`: no copy of the state, no allocation per step),
which replaces the bucket's state only once the whole step has succeeded, so a step either
changes every bucket's state or none.
Parameters, moments, error buffers and the step count are then exactly as before; the step
warns (the first time) and counts itself in `skipped_steps`.

Results are bitwise those of the non-overlapped step (`overlap = False`): the same payloads
go through the same collectives; only the time they start differs. Gradients changed in place
after backward (clipping, `GradScaler.unscale_`) are noticed in `step()`: every rank then
sends again from the current gradients (correct, but not overlapped).

GradScaler (torch's `_step_supports_amp_scaling` protocol): `step()` reads the scaler's
`grad_scale` and `found_inf`, divides the gradients by the scale and skips on an agreed
verdict. Once a scaler has been seen, the ranks also agree at the end of each backward on
whether any gradient is non-finite, and a rank whose own gradients are finite then marks one
of them NaN, so that every rank's scaler finds the inf and backs off alike: the scales stay
equal on every rank. The first backward is agreed the same way (no scaler has been seen
yet), and its payloads go out in `step()`.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.profiler import record_function

from ..allreduce import compressed_allreduce
from ..backends import Backend, resolve
from ..collective import all_gather_object, all_sum, raise_everywhere
from ..error_feedback import ErrorFeedback
from ..errors import NonFiniteError, all_finite
from ..layout import DEFAULT_BUCKET_BYTES, Bucketer
from ..ordering import Pending
from .readiness import Readiness
from .timing import CommClock, CommTiming
from .updates import PARAM_DTYPES, check_range

EXACT, COMPRESSED, LOCAL = "exact", "compressed", "local"
_EXTRA_KEY = "compcomm"
_HASH_MOD = 1 << 20


@dataclass
class _Launch:
    handle: Pending | None  # None: nothing sent (a local step)
    errors: ErrorFeedback | None  # the bucket's error feedback after the call, kept if the step completes


@dataclass
class _Round:
    """The communication of one step, from the first ready gradient to `step()`."""

    t: int
    kind: str
    scale: float | None
    launches: dict[int, _Launch] = field(default_factory=dict)
    waiting: list[set[int]] = field(default_factory=list)  # per bucket: parameters not yet ready
    versions: list[Any] | None = None  # the gradients at the end of backward (None: not ended)
    bad: bool | None = None  # the verdict, when the ranks took it at the end of the first backward
    clock: CommClock = field(default_factory=CommClock)


class OnebitOptimizer(torch.optim.Optimizer):
    """Base class of the compressed optimizers; subclasses supply the update rules.

    Subclass hooks (under `torch.no_grad()`, fp32 tensors, parameters in group order):
      `_kind(t)`                          "exact", "compressed" or "local" for step t;
      `_payload(t, kind, p, group, g, out)`  write parameter p's payload into `out` from its
                                          local, unscaled fp32 gradient g (default: g itself);
      `_apply(t, kind, values)`           the update, from the averaged payloads (local ones
                                          for "local"), one per parameter;
      `_fresh_errors(t)`                  whether step t starts the error feedback from zero;
      `_rank_local()` / `_load_rank_local(d)`   state that differs across ranks (checkpoints).
    Instance attributes named in `_SCALARS` are checkpointed; per-parameter state named in
    `_HELD_FROM_START` is allocated (zeros) with the moments.

    The optimizer performs all gradient communication: do not wrap the model in DDP, start
    every rank from the same parameters, and run backward and `step()` on every rank together.
    `bucket_bytes` (25 MiB, as DDP) and `overlap` (True) are class attributes; set them on an
    instance before its first backward to change them. After each step, `last_comm_timing`
    says how long its collectives ran and how much of that was hidden behind backward.
    """

    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    overlap: bool = True
    _step_supports_amp_scaling = True  # torch.amp.GradScaler hands us grad_scale / found_inf
    _SCALARS: tuple[str, ...] = ()
    # Per-parameter fp32 state that a later stage fills (with copy_), allocated with the moments:
    # on a CPU a fresh tensor's pages fault in on first touch, which made the step that
    # allocated it (4 ranks on 2 cores, 11M parameters) cost up to 280 ms more than its
    # arithmetic. Held from the first step, that cost lands there; the peak is unchanged.
    _HELD_FROM_START: tuple[str, ...] = ()

    def __init__(self, params: Iterable, defaults: dict[str, Any], backend: Backend | str | None) -> None:
        if backend is not None and not isinstance(backend, (str, Backend)):
            raise TypeError(f"backend must be a name, a compcomm Backend or None, got {type(backend).__name__}")
        super().__init__(params, defaults)
        self._backend_arg = backend
        self._backend: Backend | None = None
        self._bucketer: Bucketer | None = None
        self._bucket_of: dict[int, int] = {}
        self._order: list[int] = []  # bucket slot -> parameter index, set by _layout
        self._error_feedback: list[ErrorFeedback] = []
        self._spare_errors: list[ErrorFeedback] = []  # per bucket: where a step's call writes
        self._group_of: list[dict[str, Any]] = []  # parameter index -> its group
        self._scratch: dict[tuple[int, torch.device], torch.Tensor] = {}
        self.last_comm_timing: CommTiming | None = None
        self._step_count = 0
        self._round: _Round | None = None
        self._last_scale: float | None = None
        self.last_step_skipped = False
        self.skipped_steps = 0
        self._readiness = Readiness(self._params(), self._grad_ready, self._backward_done)

    # ----------------------------------------------------------------- parameters and layout

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_readiness", None) is not None:
            raise RuntimeError(
                "add every parameter group when building the optimizer: the communication "
                "buckets (and their error feedback) cover a fixed set of parameters"
            )
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        self._check_group(group)
        for p in group["params"]:
            if p.dtype not in PARAM_DTYPES:
                raise ValueError(f"parameters must be float32 or bfloat16, got {p.dtype}")
        mask = group.get("exp_avg_mask")
        if mask is not None:
            for p in group["params"]:
                if not torch.is_tensor(mask) or torch.broadcast_shapes(mask.shape, p.shape) != p.shape:
                    raise ValueError(
                        f"exp_avg_mask must be a tensor broadcastable to each parameter of "
                        f"its group, got {getattr(mask, 'shape', mask)} for {tuple(p.shape)}"
                    )

    def _check_group(self, group: dict[str, Any]) -> None:
        """ValueError for invalid hyperparameters of one group (subclasses extend it)."""
        check_range("lr", group["lr"], 0.0)
        check_range("eps", group["eps"], 0.0)
        check_range("weight_decay", group["weight_decay"], 0.0)
        betas = group["betas"]
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"invalid betas: {betas!r} (must be a pair)")
        check_range("betas[0]", betas[0], 0.0, 1.0, high_open=True)
        check_range("betas[1]", betas[1], 0.0, 1.0, high_open=True)

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def _entries(self, values: Sequence[torch.Tensor]) -> Iterator[tuple[torch.Tensor, torch.Tensor, dict, dict]]:
        """(parameter, its value, its group, its state) for every parameter that is trained:
        one with requires_grad=False gets no update at all (no weight decay), as in torch.optim."""
        i = 0
        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    yield p, values[i].view_as(p), group, self.state[p]
                i += 1

    @property
    def backend(self) -> Backend:
        """The transport, resolved on first use like `compressed_allreduce`'s `backend`."""
        if self._backend is None:
            params = self._params()
            self._backend = resolve(self._backend_arg, params[0] if params else None)
        return self._backend

    def _layout(self, order: Sequence[int] | None = None) -> Bucketer:
        """The fp32 buckets (and one ErrorFeedback per bucket), built once, parameters taken in
        `order` (default: the reverse of the parameter order, the usual order of readiness)."""
        if self._bucketer is None:
            params = self._params()
            if not params:
                raise ValueError("the optimizer has no parameters")
            self._order = list(order) if order is not None else list(range(len(params)))[::-1]
            self._bucketer = Bucketer(
                [params[i] for i in self._order], self.bucket_bytes, self.backend.world_size, dtype=torch.float32
            )
            for b, bucket in enumerate(self._bucketer):
                for k in bucket.indices:
                    self._bucket_of[self._order[k]] = b
            name = type(self).__name__
            self._error_feedback = [ErrorFeedback(tag=f"{name}.bucket{b}") for b in range(len(self._bucketer))]
            self._spare_errors = [ErrorFeedback(tag=ef.tag) for ef in self._error_feedback]
            self._group_of = [group for group in self.param_groups for _ in group["params"]]
        return self._bucketer

    def _scratch_like(self, like: torch.Tensor, slot: int = 0) -> torch.Tensor:
        """A reusable fp32 temporary shaped like `like` (its content is garbage): update rules
        take their temporaries from a few of these instead of allocating each step. Slots
        are independent; one slot serves one temporary at a time."""
        key = (slot, like.device)
        buf = self._scratch.get(key)
        if buf is None or buf.numel() < like.numel():
            buf = self._scratch[key] = torch.empty(like.numel(), dtype=torch.float32, device=like.device)
        return buf[: like.numel()].view(like.shape)

    def _ready_order(self) -> list[int]:
        """The order of readiness seen so far, then the remaining parameters in reverse order."""
        seen = self._readiness.order
        rest = [i for i in range(len(self._params()))[::-1] if i not in set(seen)]
        return seen + rest

    @property
    def step_count(self) -> int:
        """Steps taken so far (skipped steps do not count)."""
        return self._step_count

    @property
    def compressing(self) -> bool:
        """Whether the next step averages with the 1-bit compressed allreduce."""
        return self._kind(self._step_count + 1) == COMPRESSED

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients in `.grad` without communicating (like
        DDP's `no_sync`); the first backward after the block communicates the accumulated sum."""
        with self._readiness.paused():
            yield

    # ----------------------------------------------------------------- communication

    def _grads(self) -> list[torch.Tensor | None]:
        grads = [p.grad for p in self._params()]
        if any(g is not None and g.is_sparse for g in grads):
            raise RuntimeError("the compressed optimizers do not support sparse gradients")
        return grads

    @staticmethod
    def _versions(grads: Sequence[torch.Tensor | None]) -> list[Any]:
        return [None if g is None else (id(g), g._version) for g in grads]

    def _new_round(self, scale: float | None) -> _Round:
        t = self._step_count + 1
        rnd = _Round(t=t, kind=self._kind(t), scale=scale)
        params = self._params()
        rnd.waiting = [
            {self._order[k] for k in bucket.indices if params[self._order[k]].requires_grad}
            for bucket in self._layout()
        ]
        return rnd

    def _cancel(self) -> None:
        """Drop the current round: wait for its collectives and forget their results."""
        rnd, self._round = self._round, None
        if rnd is None:
            return
        for launch in rnd.launches.values():
            try:
                if launch.handle is not None:
                    launch.handle.wait()
            except Exception:
                pass  # the round is dropped: its results (and failures) no longer matter

    def _launch(self, rnd: _Round, b: int) -> None:
        """Fill bucket b with this rank's payloads and start its collective (if the step sends)."""
        bucket = self._layout().buckets[b]
        params = self._params()
        with record_function("compcomm.optim.payload"):
            for view, k in zip(bucket.views, bucket.indices):
                p, group = params[self._order[k]], self._group_of[self._order[k]]
                g = p.grad
                g = torch.zeros_like(p, dtype=torch.float32) if g is None or not p.requires_grad else g.float()
                if rnd.scale is not None:
                    g = g / rnd.scale
                self._payload(rnd.t, rnd.kind, p, group, g, view.view_as(p))
        if rnd.kind == LOCAL:
            rnd.launches[b] = _Launch(None, None)
            return
        with record_function("compcomm.optim.submit"):
            rnd.launches[b] = self._submit(rnd, b)

    def _submit(self, rnd: _Round, b: int) -> _Launch:
        """Start bucket b's collective on its filled buffer."""
        bucket, be = self._layout().buckets[b], self.backend
        index = rnd.clock.submit()
        if rnd.kind == EXACT:
            launch = _Launch(be.all_reduce(bucket.flat, "mean", async_op=True), None)
        else:
            # The call starts from the kept error feedback and writes the new errors into the
            # bucket's spare (no copy of the kept one first); the two swap roles if the whole
            # step completes, else the kept one is still the state before the step.
            work = self._spare_errors[b]
            # errors restarted from zero: an unused source (the spare's buffers are zeroed, kept)
            source = ErrorFeedback(tag=work.tag) if self._fresh_errors(rnd.t) else self._error_feedback[b]
            launch = _Launch(
                compressed_allreduce(
                    bucket.flat, source, backend=be, op="mean", async_op=True, error_feedback_out=work
                ),
                work,
            )
        assert launch.handle is not None
        launch.handle.get_future().add_done_callback(lambda _: rnd.clock.complete(index))
        return launch

    def _launch_rest(self, rnd: _Round) -> None:
        for b in range(len(self._layout())):
            if b not in rnd.launches:
                self._launch(rnd, b)

    def _locally_bad(self, found_inf: bool = False) -> bool:
        """Whether this rank's gradients hold NaN/Inf (or its GradScaler found some)."""
        return found_inf or any(g is not None and not all_finite(g) for g in self._grads())

    def _payload_shows_nonfinite(self, kind: str) -> bool:
        """Whether any non-finite gradient makes this step's payload non-finite, so that the
        collective itself finds it on every rank alike (an exact average becomes non-finite
        everywhere; a compressed call raises NonFiniteError everywhere) and `step()` need not
        scan the gradients first. True for exact steps; subclasses say so for compressed ones."""
        return kind == EXACT

    def _current_round(self) -> _Round:
        """The round of the coming step; a backward after the last one ended starts it over."""
        rnd = self._round
        if rnd is None or rnd.versions is not None or rnd.t != self._step_count + 1:
            self._cancel()
            rnd = self._round = self._new_round(self._last_scale)
        return rnd

    def _grad_ready(self, i: int) -> None:
        """Hook: parameter i's gradient is accumulated; start its bucket if that completes it."""
        if not self.overlap or self._bucketer is None:
            return
        rnd = self._current_round()
        if rnd.kind == LOCAL:
            return
        b = self._bucket_of[i]
        waiting = rnd.waiting[b]
        waiting.discard(i)
        if not waiting and b not in rnd.launches:
            self._launch(rnd, b)

    def _backward_done(self) -> None:
        """Callback at the end of a backward: start the buckets left (their gradients never came:
        zeros) and note the gradients sent. At the first backward, and at every backward once a
        GradScaler has been seen, the ranks also agree here on whether any gradient is
        non-finite (`_agree_before_scaler`); the first time, the same all-reduce agrees on the
        order of readiness, and the buckets are laid out."""
        if self._bucketer is None:
            order = self._ready_order()
            key = float(hash(tuple(order)) % _HASH_MOD)
            bad, keys, squares = self._agree_before_scaler([key, key * key])
            n = self.backend.world_size
            self._layout(order if keys == n * key and squares == n * key * key else None)
            rnd = self._round = self._new_round(self._last_scale)
            rnd.bad = bad  # its payloads go out in step(), from the gradients as they are then
        else:
            rnd = self._current_round()
            rnd.clock.backward_ended()
            if self.overlap and rnd.kind != LOCAL:
                self._launch_rest(rnd)
            if self._last_scale is not None:
                self._agree_before_scaler([])
        rnd.versions = self._versions(self._grads())

    def _agree_before_scaler(self, extra: list[float]) -> list[Any]:
        """All-reduce of (some rank's gradients are non-finite, *extra); a rank whose own are
        finite then marks one of them NaN, so that a GradScaler's inf check, which runs before
        `step()`, finds the inf on every rank and every scale backs off alike."""
        bad = self._locally_bad()
        total, *rest = all_sum([1.0 if bad else 0.0, *extra], self.backend)
        if total and not bad:
            first = next((g for g in self._grads() if g is not None and g.numel()), None)
            if first is not None:
                first[(0,) * first.dim()] = float("nan")
        return [bool(total), *rest]

    # ----------------------------------------------------------------- the step

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One optimizer step on every rank (all ranks must call it together).

        Returns the closure's loss, if a closure was given. When any rank's gradients hold
        NaN/Inf (or a GradScaler found inf on any rank), or an average overflows, every rank
        skips the step and `last_step_skipped` is True: parameters, moments, error buffers and
        the step count are left exactly as they were.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        scale_tensor = getattr(self, "grad_scale", None)
        scale = None if scale_tensor is None else float(scale_tensor)
        found_inf = bool(float(getattr(self, "found_inf", 0.0)))
        t = self._step_count + 1
        with record_function("compcomm.optim.wait"):  # the verdict queues behind the collectives
            bad, rnd = self._agree(t, scale, found_inf)
            self._last_scale = scale
            self._launch_rest(rnd)
            values, failure = self._collect(rnd)
        if failure is not None or bad:
            self._skip(failure)
            return loss
        self._round = None
        self.last_comm_timing = rnd.clock.timing()
        for b, launch in rnd.launches.items():
            if launch.errors is not None:
                self._error_feedback[b], self._spare_errors[b] = launch.errors, self._error_feedback[b]
        with record_function("compcomm.optim.update"):
            self._apply(t, rnd.kind, values)
        self._step_count = t
        self.last_step_skipped = False
        return loss

    def _agree(self, t: int, scale: float | None, found_inf: bool) -> tuple[bool, _Round]:
        """Step t's verdict (taken now, or at the first backward) and its round."""
        rnd = self._round
        if rnd is not None and rnd.bad is not None and rnd.t == t:  # agreed at the first backward
            rnd.scale = scale
            return rnd.bad, rnd
        bad = self._verdict(scale, found_inf)
        assert self._round is not None  # _verdict opened this step's round
        return bad, self._round

    def _verdict(self, scale: float | None, found_inf: bool) -> bool:
        """The step's one all-reduce: is some rank's gradient non-finite? did some rank change its
        gradients after backward (or skip backward's hooks), so that every rank must send again?
        and, if the buckets are not laid out yet, do the ranks see the same order of readiness
        (else the reverse parameter order is used everywhere)? Returns the first answer."""
        rnd, t = self._round, self._step_count + 1
        stale = rnd is None or rnd.t != t or rnd.scale != scale or rnd.versions != self._versions(self._grads())
        order = self._ready_order()
        key = float(hash(tuple(order)) % _HASH_MOD)
        kind = self._kind(t)
        here = found_inf or (not self._payload_shows_nonfinite(kind) and self._locally_bad())
        bad, restart, keys, squares = all_sum([float(here), float(stale), key, key * key], self.backend)
        if self._bucketer is None:
            n = self.backend.world_size
            self._layout(order if keys == n * key and squares == n * key * key else None)
        if restart or self._round is None:
            self._cancel()
            self._round = self._new_round(scale)
        return bool(bad)

    def _collect(self, rnd: _Round) -> tuple[list[torch.Tensor], Exception | None]:
        """Wait for every bucket; the averaged (or local) payloads in parameter order, and why
        the step must be skipped (the same on every rank), if it must."""
        failure: Exception | None = None
        for launch in rnd.launches.values():
            try:
                if launch.handle is not None:
                    launch.handle.wait()
            except NonFiniteError as exc:
                failure = failure or exc
        values: list[torch.Tensor] = [None] * len(self._params())  # type: ignore[list-item]
        for bucket in self._layout():
            if failure is None and rnd.kind == EXACT and not all_finite(bucket.flat):
                failure = NonFiniteError("the average of finite values overflowed fp32")
            for k, view in zip(bucket.indices, bucket.views):
                values[self._order[k]] = view
        return values, failure

    def _skip(self, failure: Exception | None) -> None:
        self._cancel()
        self.last_step_skipped = True
        self.skipped_steps += 1
        if self.skipped_steps == 1:
            why = failure or "non-finite gradients (NaN/Inf) on some rank"
            warnings.warn(
                f"{type(self).__name__}: step skipped on every rank ({why}); nothing changed. "
                "Further skips are counted in `skipped_steps` without warning again.",
                RuntimeWarning,
                stacklevel=3,
            )

    # ----------------------------------------------------------------- subclass hooks

    def _kind(self, t: int) -> str:
        raise NotImplementedError

    def _payload(
        self, t: int, kind: str, p: torch.Tensor, group: dict[str, Any], g: torch.Tensor, out: torch.Tensor
    ) -> None:
        out.copy_(g)

    def _moments(self, p: torch.Tensor) -> dict[str, Any]:
        """The parameter's state, with fp32 zero moments, and the `_HELD_FROM_START` buffers,
        on first use."""
        state = self.state[p]
        for name in ("exp_avg", "exp_avg_sq", *self._HELD_FROM_START):
            if name not in state:
                state[name] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
        return state

    def _apply(self, t: int, kind: str, values: Sequence[torch.Tensor]) -> None:
        raise NotImplementedError

    def _fresh_errors(self, t: int) -> bool:
        return False

    def _rank_local(self) -> dict[str, Any]:
        return {}

    def _load_rank_local(self, local: dict[str, Any]) -> None:
        """Restore what `_rank_local()` returned."""

    # ----------------------------------------------------------------- checkpoints

    def state_dict(self) -> dict[str, Any]:
        """torch's optimizer state plus, under "compcomm", what exact resumption needs: the step
        count, the rank and world size, the bucket layout, each bucket's error feedback (which
        belongs to this rank) and any other state of this rank alone. Save it on every rank, or
        use `gathered_state_dict()` for one file that serves all ranks. (A step in flight is not
        part of it: its collectives update copies that only the step itself keeps.)"""
        sd = super().state_dict()
        self._layout()
        sd[_EXTRA_KEY] = {
            "step": self._step_count,
            "rank": self.backend.rank,
            "world_size": self.backend.world_size,
            "bucket_order": list(self._order or ()),
            "bucket_numels": [b.numel for b in self._layout()],
            "scalars": {name: copy.deepcopy(getattr(self, name)) for name in self._SCALARS},
            "error_feedback": [ef.state_dict() for ef in self._error_feedback],
            "rank_local": self._rank_local(),
        }
        return sd

    def gathered_state_dict(self) -> dict[str, Any]:
        """A state dict for all ranks at once (collective: call it on every rank, save it from one).

        The parts that differ across ranks (error feedback, local state) of every rank are
        gathered under "compcomm"/"ranks"; `load_state_dict` on each rank picks its own, so the
        file resumes every rank exactly."""
        sd = self.state_dict()
        extra = sd[_EXTRA_KEY]
        mine = {key: extra.pop(key) for key in ("rank", "error_feedback", "rank_local")}
        extra["ranks"] = all_gather_object(mine, self.backend)
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume from `state_dict()` or `gathered_state_dict()`: bit for bit on the same ranks.

        Collective: every rank calls it. A state saved by another rank (e.g. rank 0's file loaded
        everywhere), by another world size, or for other parameters raises ValueError on every
        rank, with nothing loaded. `drop_error_feedback(sd)` gives a copy that loads on any rank
        and world size, with zero error buffers (a documented reset).
        """
        self._cancel()
        extra = state_dict.get(_EXTRA_KEY) if isinstance(state_dict, dict) else None
        problem = None if extra is not None else f"not a {type(self).__name__} state dict (no {_EXTRA_KEY!r} entry)"
        mine: dict[str, Any] = {}
        if extra is not None:
            order = extra.get("bucket_order")
            valid = isinstance(order, list) and sorted(order) == list(range(len(self._params())))
            self._layout(order if valid else None)
            mine, problem = self._own_part(extra)
        raise_everywhere(problem, self.backend)
        assert extra is not None  # else problem was raised on every rank
        plain = {k: v for k, v in state_dict.items() if k != _EXTRA_KEY}
        super().load_state_dict(plain)
        # torch casts floating state to the parameter dtype; keep ours exactly as saved (fp32).
        index = [i for g in plain["param_groups"] for i in g["params"]]
        for i, p in zip(index, self._params()):
            saved = plain["state"].get(i)
            if saved is not None:
                self.state[p] = {
                    k: v.detach().clone().to(p.device) if torch.is_tensor(v) else copy.deepcopy(v)
                    for k, v in saved.items()
                }
        self._step_count = int(extra["step"])
        for name, value in extra.get("scalars", {}).items():
            setattr(self, name, copy.deepcopy(value))
        for ef, saved in zip(self._error_feedback, mine["error_feedback"]):
            ef.load_state_dict(saved)
        self._load_rank_local(mine.get("rank_local") or {})

    def _own_part(self, extra: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
        """This rank's share of a checkpoint, and why it cannot be loaded here (None if it can)."""
        world, rank = self.backend.world_size, self.backend.rank
        saved_world = extra.get("world_size")
        if saved_world is not None and saved_world != world:
            return {}, (
                f"this checkpoint was saved on {saved_world} ranks and cannot resume on {world}: "
                "its error-feedback buffers belong to another split of the buckets. To resume "
                "anyway with the errors reset to zero, load "
                "OnebitOptimizer.drop_error_feedback(state_dict)"
            )
        numels = [b.numel for b in self._layout()]
        if (
            list(extra.get("bucket_numels", [])) != numels
            or list(extra.get("bucket_order") or self._order) != self._order
        ):
            return {}, (
                f"the checkpoint's buckets ({extra.get('bucket_numels')} elements) do not match "
                f"this optimizer's ({numels}): different parameters or bucket_bytes"
            )
        if "ranks" in extra:
            return extra["ranks"][rank], None
        saved_rank = extra.get("rank")
        if saved_rank is not None and saved_rank != rank:
            return {}, (
                f"this checkpoint holds the state of rank {saved_rank}, not of rank {rank}: its "
                "error feedback (and any local state) belongs to that rank. Save one file per "
                "rank, or one file for all ranks with gathered_state_dict()"
            )
        return extra, None

    @staticmethod
    def drop_error_feedback(state_dict: dict[str, Any]) -> dict[str, Any]:
        """A copy of `state_dict` without per-rank state, loadable on any rank and world size (a
        documented reset: the compression errors carried so far are forgotten)."""
        out = dict(state_dict)
        extra = dict(out[_EXTRA_KEY])
        extra.pop("ranks", None)
        extra["world_size"] = extra["rank"] = None
        extra["rank_local"] = {}
        extra["error_feedback"] = [
            {"worker_error": None, "server_error": None, "numel": None, "world_size": None}
            for _ in extra["bucket_numels"]
        ]
        out[_EXTRA_KEY] = extra
        return out

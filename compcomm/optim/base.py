"""What the compressed optimizers share: parameter checks, the step, the hooks of their update rules.

A step is all-or-nothing on every rank: if any rank's gradients (or a GradScaler's inf check)
are non-finite, or an average is non-finite (an fp32 overflow of finite inputs), every rank
skips the step. Parameters, moments, error buffers and the step count are then exactly as
before; the step warns (the first time) and counts itself in `skipped_steps`. The communication
of a step lives in `rounds.py` (buckets, overlap with backward, the verdict); checkpoints in
`checkpoints.py`.
"""

from __future__ import annotations

import contextlib
import copy
import math
import warnings
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, ClassVar

import torch
from torch.profiler import record_function

from .. import schedules
from ..agreement import all_max, raise_agreed
from ..backends import Backend, check_backend_argument
from ..backends.registry import resolve_for_call
from ..error_feedback import ErrorFeedback
from ..gather_objects import agree_on_values
from ..layout import DEFAULT_BUCKET_BYTES
from . import checkpoints
from .replicas import ddp_refusal, equalize_from_rank0, refuse_ddp_wrapped
from .rounds import COMPRESSED, EXACT, LOCAL, GradientRounds
from .sharded import ShardedSteps, is_sharded
from .timing import CommTiming
from .updates import PARAM_DTYPES, check_range, local

__all__ = ["COMPRESSED", "EXACT", "LOCAL", "OnebitOptimizer"]


_MOMENTS = ("exp_avg", "exp_avg_sq")
"""The fp32 moments every parameter that has been stepped holds (with `_HELD_FROM_START`)."""
_RESET_ERRORS = "To resume with the errors reset to zero, load OnebitOptimizer.drop_error_feedback(state_dict)"


class OnebitOptimizer(torch.optim.Optimizer):
    """Base class of the compressed optimizers; subclasses supply the update rules.

    Subclass hooks (under `torch.no_grad()`, fp32 tensors, parameters in group order):
      `_kind(t)`                          "exact", "compressed" or "local" for step t;
      `_payload(t, kind, p, group, g, out)`  write parameter p's payload into `out` from its
                                          local, unscaled fp32 gradient g (default: g itself);
      `_apply(t, kind, values)`           the update, from the averaged payloads (local ones
                                          for "local"), one per parameter;
      `_fresh_errors(t)`                  whether step t starts the error feedback from zero;
      `_rank_local()` / `_load_rank_local(d, extra)`   state that differs across ranks (checkpoints).
    Instance attributes named in `_SCALARS` (integers, each with its least valid value) are
    checkpointed; per-parameter state named in `_HELD_FROM_START` is allocated (zeros) with the
    moments.

    The optimizer performs all gradient communication: do not wrap the model in DDP (a
    ValueError), and run backward and `step()` on every rank together. Ranks whose parameters
    differ at the first step are made equal to rank 0's there, with a warning.
    `bucket_bytes` (25 MiB, as DDP) and `overlap` (True) are class attributes; set them on an
    instance before its first backward to change them. After each step, `last_comm_timing`
    says how long its collectives ran and how much of that was hidden behind backward.
    """

    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    overlap: bool = True
    _step_supports_amp_scaling = True  # torch.amp.GradScaler hands us grad_scale / found_inf
    _SCALARS: ClassVar[dict[str, int]] = {}
    # Per-parameter fp32 state that a later stage fills (with copy_), allocated with the moments:
    # on a CPU a fresh tensor's pages fault in on first touch, which costs more than the arithmetic
    # that fills it. Held from the first step, that cost lands there instead of on the step where
    # the stage changes; the peak is unchanged.
    _HELD_FROM_START: tuple[str, ...] = ()
    # Whether every rank holds the same per-parameter state after a step (the moments are
    # averaged), so that a checkpoint's ranks must have saved the same values.
    _SAME_MOMENTS = True
    # The schedule setting that names the step at which the variance freezes (None: none). The
    # state changes form there, so one saved at or past it goes on only under the same value.
    _FREEZE_SETTING: ClassVar[str | None] = None

    def __init__(self, params: Iterable, defaults: dict[str, Any], backend: Backend | str | None) -> None:
        check_backend_argument(backend)
        super().__init__(params, defaults)
        refuse_ddp_wrapped(self._params(), type(self).__name__)
        self._backend_arg = backend
        self._backend: Backend | None = None
        self._backend_refused: Exception | None = None  # what `backend` raised on this rank
        self._scratch: dict[tuple[int, torch.device], torch.Tensor] = {}
        self.last_comm_timing: CommTiming | None = None
        self._step_count = 0
        self.last_step_skipped = False
        self.skipped_steps = 0
        self._replicas_checked = False  # whether step 1 made the ranks' parameters equal
        if is_sharded(self._params()):
            self._check_sharded()
            self._sharded: ShardedSteps | None = ShardedSteps(self)
            self._gradient_rounds: GradientRounds | None = None
        else:
            self._sharded = None
            self._gradient_rounds = GradientRounds(self, lambda: self._transport, type(self).__name__)

    # ----------------------------------------------------------------- parameters and layout

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if hasattr(self, "_sharded"):
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
        _check_mask(group.get("exp_avg_mask"), group["params"])

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

    def _entries(
        self, values: Sequence[torch.Tensor], also: Callable[[dict], bool] | None = None
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor, dict, dict]]:
        """(parameter, its value, its group, its state) for every parameter that is trained:
        one with requires_grad=False gets no update at all (no weight decay), as in torch.optim,
        unless `also(its state)` says otherwise. The value has the shape of the parameter's
        local part (`updates.local`)."""
        i = 0
        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad or (also is not None and p in self.state and also(self.state[p])):
                    yield p, values[i].view_as(local(p)), group, self.state[p]
                i += 1

    @property
    def _rounds(self) -> GradientRounds:
        """The bucket collectives of a step (not on sharded parameters, which FSDP reduces)."""
        if self._gradient_rounds is None:
            raise RuntimeError(f"{type(self).__name__} on FSDP2-sharded parameters sends no gradients itself")
        return self._gradient_rounds

    def _backend_unused(self) -> ValueError | None:
        """On sharded parameters, a `backend` argument: `compcomm.fsdp.compress` chose the
        transports their gradients are reduced over, and this one would go unused."""
        if self._backend_arg is None:
            return None
        return ValueError(
            f"{type(self).__name__}'s backend= is not used on FSDP2-sharded parameters: their gradients are "
            "reduced by compcomm.fsdp.compress, over the transports given to it (pass backend= there)"
        )

    def _check_sharded(self) -> None:
        """ValueError where an optimizer cannot run on FSDP2-sharded parameters (subclasses)."""

    @property
    def backend(self) -> Backend:
        """The transport, resolved on first use like `compressed_allreduce`'s `backend`; raises
        what resolving the `backend` argument raised on this rank (an unknown name, one that
        cannot be built here)."""
        transport = self._transport
        if self._backend_refused is not None:
            raise self._backend_refused
        return transport

    @property
    def _transport(self) -> Backend:
        """`backend`, or where this rank cannot resolve it, the default transport: over that one
        the first step, `load_state_dict` and `gathered_state_dict` refuse it on every rank,
        every time (and `state_dict` on this rank), where raising on this rank alone would leave
        the others waiting for it."""
        if self._backend is None:
            params = self._params()
            self._backend, self._backend_refused = resolve_for_call(self._backend_arg, params[0] if params else None)
        return self._backend

    def _scratch_like(self, like: torch.Tensor, slot: int = 0) -> torch.Tensor:
        """A reusable fp32 temporary shaped like `like` (its content is garbage): update rules
        take their temporaries from a few of these instead of allocating each step. Slots
        are independent; one slot serves one temporary at a time."""
        like = local(like)
        key = (slot, like.device)
        buf = self._scratch.get(key)
        if buf is None or buf.numel() < like.numel():
            buf = self._scratch[key] = torch.empty(like.numel(), dtype=torch.float32, device=like.device)
        return buf[: like.numel()].view(like.shape)

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
        if self._sharded is not None:
            raise RuntimeError(
                "with FSDP2 the model decides when gradients are reduced: accumulate under "
                "model.set_requires_gradient_sync(False) instead of the optimizer's no_sync()"
            )
        with self._rounds.readiness.paused():
            yield

    @property
    def error_feedback(self) -> list[ErrorFeedback]:
        """Each communication bucket's error feedback (this rank's), in bucket order (none on
        sharded parameters: FSDP's reductions keep theirs in `compcomm.fsdp`'s state)."""
        if self._sharded is not None:
            return []
        return self._rounds.lay_out().error_feedback

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
        # A GradScaler sets found_inf on every step it drives; grad_scale is None after its unscale_.
        scaled = getattr(self, "found_inf", None) is not None
        found_inf = bool(float(getattr(self, "found_inf", 0.0)))
        t = self._step_count + 1
        if self._sharded is None:  # a rank without a backward this step pairs its collectives first
            self._rounds.backward_missed(t, scaled)
        if t == 1 and not self._replicas_checked:
            # Ranks that started from different parameters (a forgotten seed) would stay apart
            # for good: make them rank 0's before the first update, as DDP does at construction
            # (and warn). A resumed run starts from its checkpoint instead. Settings that differ
            # across ranks are refused there on every rank: a schedule that differs pairs
            # different collectives from the first compressed step on (every rank would wait).
            if self._sharded is None:
                be = self._transport  # resolved first: it may be refused
                failure = self._backend_refused or ddp_refusal(self._params(), type(self).__name__, since_built=True)
                equalize_from_rank0(self._params(), be, self._settings(), self._settings_differ, failure)
            else:  # FSDP made the shards; the settings alone are compared, over the model's ranks
                world = self._sharded.state.world
                raise_agreed(self._backend_unused(), world)
                agree_on_values(self._settings(), world, self._settings_differ)
            self._replicas_checked = True
        if self._sharded is not None:
            if self._sharded.agree(t, found_inf):
                self._skip(None)
                return loss
            kind = self._kind(t)
            values = self._sharded.values(t, kind, scale)
        else:
            rounds = self._rounds
            with record_function("compcomm.optim.wait"):  # the verdict queues behind the collectives
                nonfinite, rnd = rounds.agree(t, scale, found_inf)
                rounds.last_scale = scale
                rounds.scaler_seen = rounds.scaler_seen or scaled
                rounds.launch_rest(rnd)
                values, failure = rounds.collect(rnd)
            if failure is not None or nonfinite:
                self._skip(failure)
                return loss
            self.last_comm_timing = rounds.finish(rnd)
            kind = rnd.kind
        with record_function("compcomm.optim.update"):
            self._apply(t, kind, values)
        self._step_count = t
        self.last_step_skipped = False
        return loss

    def _skip(self, failure: Exception | None) -> None:
        if self._gradient_rounds is not None:
            self._gradient_rounds.cancel()
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
        for name in (*_MOMENTS, *self._HELD_FROM_START):
            if name not in state:
                state[name] = torch.zeros_like(local(p), dtype=torch.float32, memory_format=torch.preserve_format)
        return state

    def _apply(self, t: int, kind: str, values: Sequence[torch.Tensor]) -> None:
        raise NotImplementedError

    def _fresh_errors(self, t: int) -> bool:
        return False

    def _switch_step(self) -> int | None:
        """The last exact step, which sharded training's compression must match (None: none)."""
        return None

    def _schedule(self) -> dict[str, Any]:
        """The settings, beside the groups' hyperparameters, that decide which collective each
        step makes (subclasses); step 1 and `load_state_dict` check that every rank has the same."""
        return {}

    def _settings(self, groups: list[dict[str, Any]] | None = None, tensors: bool = True) -> dict[str, Any]:
        """What every rank must hold alike: the schedule, the bucketing and overlap (which decide
        the collectives of a backward), and the hyperparameters of `groups` (default: this
        optimizer's, with which of their parameters are frozen, which a rank alone could change;
        a checkpoint's, before it is loaded), their tensors unless `tensors` is False."""
        live = groups is None
        return {
            **self._schedule(),
            "bucket_bytes": self.bucket_bytes,
            "overlap": bool(self.overlap),
            **_hyperparameters(self.param_groups if groups is None else groups, tensors),
            **(_frozen(self.param_groups) if live else {}),
        }

    def _settings_key(self) -> float:
        """A digest (< 2^20) of the settings as they are now, but for tensors (a mask: compared at
        the first step only), which each step's verdict compares across ranks: a learning rate
        changed on one rank after the first step would let the parameters drift apart unseen."""
        plain = self._settings(tensors=False)
        return float(zlib.crc32(repr(sorted(plain.items())).encode()) % (1 << 20))

    def _refuse_differing_settings(self, be: Backend) -> None:
        """The ValueError naming the setting that differs, raised on every rank (each rank's
        verdict found the digests apart; a collective)."""
        agree_on_values(self._settings(), be, self._settings_differ)

    @property
    def _settings_differ(self) -> str:
        return (
            f"{type(self).__name__} must be given the same settings on every rank (else its steps pair "
            "different collectives, or its parameters drift apart)"
        )

    def _norms(self, p: torch.Tensor, tensors: Sequence[torch.Tensor]) -> list[float]:
        """The norms of whole tensors shaped like parameter p, from their parts on this rank
        (reduced across p's shards when p is sharded)."""
        norms = [float(torch.linalg.vector_norm(t)) for t in tensors]
        if self._sharded is None:
            return norms
        return [math.sqrt(total) for total in self._sharded.all_sum(p, [x * x for x in norms])]

    def _max(self, p: torch.Tensor, value: float) -> float:
        """The largest of `value` over p's shards (value itself when p is not sharded)."""
        if self._sharded is None:
            return value
        return all_max([value], self._sharded.state.shard_backend(p))[0]

    def _payload_shows_nonfinite(self, kind: str) -> bool:
        """Whether any non-finite gradient makes this step's payload non-finite, so that the
        collective itself finds it on every rank alike (an exact average becomes non-finite
        everywhere; a compressed call raises NonFiniteError everywhere) and `step()` need not
        scan the gradients first. True for exact steps; subclasses say so for compressed ones."""
        return kind == EXACT

    def _rank_local(self) -> dict[str, Any]:
        return {}

    def _load_rank_local(self, local: dict[str, Any], extra: dict[str, Any]) -> None:
        """Restore what `_rank_local()` returned (`extra`: the checkpoint's "compcomm" entry)."""

    def _rank_local_problem(self, local: dict[str, Any], extra: dict[str, Any]) -> str | None:
        """Why `_load_rank_local(local, extra)` cannot restore `local` here (None if it can):
        asked before the load's agreement, so that one rank's unusable part is refused on every
        rank."""
        return None

    # ----------------------------------------------------------------- checkpoints

    def state_dict(self) -> dict[str, Any]:
        """torch's optimizer state plus, under "compcomm", what exact resumption needs: the step
        count, the rank and world size, the bucket layout, each bucket's error feedback (which
        belongs to this rank) and any other state of this rank alone. Save it on every rank, or
        use `gathered_state_dict()` for one file that serves all ranks. (A step in flight is not
        part of it: its collectives update copies that only the step itself keeps.) On sharded
        parameters the whole state is this rank's shards'."""
        sd = super().state_dict()
        scalars = {name: copy.deepcopy(getattr(self, name)) for name in self._SCALARS}
        if self._sharded is not None:
            entry = checkpoints.sharded_entry(
                self._checkpoint_kind(), self._step_count, self._sharded.state.world, scalars, self._rank_local()
            )
        else:
            be = self.backend  # raises a refusal: its rank and world size would be the default's
            layout = self._rounds.lay_out()
            entry = checkpoints.compcomm_entry(
                self._checkpoint_kind(), self._step_count, be, layout, scalars, self._rank_local()
            )
        entry["schedule"] = self._schedule()  # a load checks the state's stage against its own
        sd[checkpoints.EXTRA_KEY] = entry
        return sd

    def gathered_state_dict(self) -> dict[str, Any]:
        """A state dict for all ranks at once (collective: call it on every rank, save it from one).

        The parts that differ across ranks (error feedback, local state; on sharded parameters
        everything) of every rank are gathered under "compcomm"/"ranks"; `load_state_dict` on
        each rank picks its own, so the file resumes every rank exactly."""
        if self._sharded is not None:
            return checkpoints.gathered_sharded(self.state_dict(), self._sharded.state.world)
        be = self._transport  # resolved first: it may be refused
        raise_agreed(self._backend_refused, be)
        return checkpoints.gathered(self.state_dict(), be)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume from `state_dict()` or `gathered_state_dict()`: bit for bit on the same ranks.

        Collective: every rank calls it. A state saved by another rank (e.g. rank 0's file loaded
        everywhere), by another world size, or for other parameters raises ValueError on every
        rank, with nothing loaded. `drop_error_feedback(sd)` gives a copy that loads on any rank
        and world size, with zero error buffers (a documented reset).
        """
        if self._gradient_rounds is not None:
            self._gradient_rounds.cancel()
        be = self._transport if self._sharded is None else self._sharded.state.world
        # Reading the state lays the buckets out in its order; a refused load must leave them as
        # they were, or the ranks that got that far would skip the first backward's agreement
        # on the order that the others run (gloo then fails on mismatched sizes).
        laid_out = None if self._sharded is not None else self._rounds.layout
        mine: dict[str, Any] = {}
        plain: dict[str, Any] = {}
        position: dict[str, Any] = {}
        settings: dict[str, Any] = {}
        try:
            try:  # whatever this rank finds wrong is raised on every rank, before anything is loaded
                state_dict, extra, mine, problem = self._own_state(state_dict, be)
                if problem is None:  # what the agreements below compare, read here for the same reason
                    assert extra is not None
                    plain = {k: v for k, v in state_dict.items() if k != checkpoints.EXTRA_KEY}
                    position["step"] = int(extra["step"])
                    if self._sharded is None:  # sharded, each rank holds its shards' state
                        scalars = extra.get("scalars")
                        position["state"] = checkpoints.state_digest(plain["state"], scalars, self._SAME_MOMENTS)
                    settings = self._settings(plain.get("param_groups", []))
            except Exception as exc:  # refused on every rank below
                extra, problem = None, checkpoints.unreadable(type(self).__name__, exc)
            failure = self._backend_refused if self._sharded is None else None
            raise_agreed(failure or (None if problem is None else ValueError(problem)), be)
            assert extra is not None  # else raised on every rank
            checkpoints.agree_on_position(position, be)
            # The schedule is this object's, not the checkpoint's: a rank resumed with another
            # freeze_step would pair other collectives from its next compressed step on.
            agree_on_values(settings, be, self._settings_differ)
        except BaseException:
            if self._sharded is None:
                self._rounds.layout = laid_out
            raise
        super().load_state_dict(plain)
        # torch casts floating state to the parameter dtype; keep ours exactly as saved (fp32).
        # An fp32 parameter is its own master: a bf16 run's saved master would be kept unchanged
        # and saved again, and a later resume in bf16 would step from it, not from the weights.
        index = [i for g in plain["param_groups"] for i in g["params"]]
        for i, p in zip(index, self._params()):
            saved = plain["state"].get(i)
            if saved is not None:
                self.state[p] = {
                    k: v.detach().clone().to(p.device) if torch.is_tensor(v) else copy.deepcopy(v)
                    for k, v in saved.items()
                    if not (k == "master" and p.dtype == torch.float32)
                }
        self._step_count = int(extra["step"])
        for name, value in extra.get("scalars", {}).items():
            setattr(self, name, copy.deepcopy(value))
        if self._gradient_rounds is not None:
            for ef, saved in zip(self._rounds.lay_out().error_feedback, mine["error_feedback"]):
                ef.load_state_dict(saved)
            # The buckets are laid out, which a run's first backward would do (and agree on
            # non-finite gradients there, before a GradScaler looks); a resumed run's does so too.
            self._gradient_rounds.resumed = True
        self._load_rank_local(mine.get("rank_local") or {}, extra)

    def _own_state(
        self, state_dict: Any, be: Backend
    ) -> tuple[dict[str, Any], dict[str, Any] | None, dict[str, Any], str | None]:
        """(this rank's state dict, its "compcomm" entry, this rank's part of it, why it cannot
        load here or None); raises on a state dict too malformed to read."""
        extra = state_dict.get(checkpoints.EXTRA_KEY) if isinstance(state_dict, dict) else None
        if extra is None:
            return state_dict, None, {}, f"not a {type(self).__name__} state dict (no {checkpoints.EXTRA_KEY!r} entry)"
        mine: dict[str, Any] = {}
        if self._sharded is not None:
            state_dict, problem = checkpoints.own_sharded(state_dict, be)
            extra = mine = state_dict[checkpoints.EXTRA_KEY]
        else:
            layout = self._rounds.lay_out(checkpoints.saved_order(extra, len(self._params())))
            mine, problem = checkpoints.own_part(extra, be, layout)
            if problem is None and self._gradient_rounds is not None:
                served = [schedules.serves(be)(numel) for numel in layout.sizes()]
                problem = checkpoints.error_feedback_problem(mine["error_feedback"], served, _RESET_ERRORS)
        if problem is None:
            problem = checkpoints.state_problem(
                self._checkpoint_kind(),
                extra,
                state_dict["state"],
                self._params(),
                _MOMENTS,
                self._HELD_FROM_START,
                self._SCALARS,
            )
        if problem is None and self._FREEZE_SETTING is not None:
            problem = checkpoints.freeze_problem(extra, self._FREEZE_SETTING, getattr(self, self._FREEZE_SETTING))
        if problem is None:
            problem = self._rank_local_problem(mine.get("rank_local") or {}, extra)
        if problem is None:
            saved_sizes = [len(g["params"]) for g in state_dict["param_groups"]]
            sizes = [len(g["params"]) for g in self.param_groups]
            if saved_sizes != sizes:  # torch's own load would raise it here alone, after the agreement
                problem = f"the checkpoint's parameter groups hold {saved_sizes} parameters, this optimizer's {sizes}"
        if problem is None:
            problem = self._groups_problem(state_dict["param_groups"])
        return state_dict, extra, mine, problem

    def _groups_problem(self, saved: list[dict[str, Any]]) -> str | None:
        """Why a checkpoint's parameter groups cannot be loaded (None if they can): torch's load
        takes their hyperparameters as saved, and a step would then use an lr < 0, a beta >= 1
        or a mask of another shape without a word, or fail at some later step."""
        for i, (group, own) in enumerate(zip(saved, self.param_groups)):
            try:
                self._check_group(group)
                _check_mask(group.get("exp_avg_mask"), own["params"])
            except ValueError as exc:
                return f"the checkpoint's parameter group {i}: {exc}"
        return None

    @classmethod
    def _checkpoint_kind(cls) -> str:
        """The compcomm optimizer this class is or derives from (a user's subclass that logs
        holds the same state): what a checkpoint names and a load compares."""
        return next(k.__name__ for k in cls.__mro__ if k.__module__.startswith("compcomm.optim"))

    drop_error_feedback = staticmethod(checkpoints.drop_error_feedback)
    """`OnebitOptimizer.drop_error_feedback(sd)`: a copy of the state dict `sd` without per-rank
    state, loadable on any rank and world size (a documented reset: the compression errors
    carried so far are forgotten)."""


def _check_mask(mask: Any, params: list[torch.Tensor]) -> None:
    """ValueError unless `mask` (a group's exp_avg_mask) is None or a tensor that broadcasts to
    each of the group's parameters (their whole shape, also where they are sharded)."""
    if mask is None:
        return
    for p in params:
        try:
            fits = torch.is_tensor(mask) and torch.broadcast_shapes(mask.shape, p.shape) == p.shape
        except RuntimeError:  # shapes that do not broadcast at all
            fits = False
        if not fits:
            raise ValueError(
                f"exp_avg_mask must be a tensor broadcastable to each parameter of "
                f"its group, got {getattr(mask, 'shape', mask)} for {tuple(p.shape)}"
            )


def _frozen(groups: list[dict[str, Any]]) -> dict[str, Any]:
    """The positions, per group, of the parameters with requires_grad=False: a parameter frozen
    on some ranks only is updated on the others, and the parameters drift apart unseen."""
    return {
        f"param_groups[{i}] parameters frozen (requires_grad=False)": tuple(
            j for j, p in enumerate(group["params"]) if not p.requires_grad
        )
        for i, group in enumerate(groups)
    }


def _hyperparameters(groups: list[dict[str, Any]], tensors: bool = True) -> dict[str, Any]:
    """The groups' settings as compared across ranks, named `param_groups[i].key`: plain values
    (numbers, strings, None, and sequences of them, as tuples) as they are, and tensors (an
    `exp_avg_mask`) by shape, dtype and a digest of their bytes, unless `tensors` is False; the
    parameters and their names, and objects that other code may have added, are left out."""

    def plain(v: Any) -> bool:
        if isinstance(v, (tuple, list)):
            return all(plain(x) for x in v)
        return v is None or isinstance(v, (bool, int, float, str))

    def compared(v: Any) -> Any:
        if torch.is_tensor(v):
            return (tuple(v.shape), str(v.dtype), checkpoints.crc32_of([v]))
        return tuple(v) if isinstance(v, list) else v

    return {
        f"param_groups[{i}].{k}": compared(v)
        for i, group in enumerate(groups)
        for k, v in group.items()
        if k not in ("params", "param_names") and (plain(v) or (tensors and torch.is_tensor(v)))
    }

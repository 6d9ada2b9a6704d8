"""A DDP communication hook that averages gradient buckets with the 1-bit allreduce.

    state = compcomm.ddp.OnebitHookState(process_group=None, start_iter=10, backend=None)
    ddp_model.register_comm_hook(state, compcomm.ddp.onebit_hook)

For a DDP bucket holding the flattened local gradients g_r of rank r (n ranks), iteration t:

    t <  start_iter:   g <- sum_r (g_r * (1/n))          uncompressed, exactly what DDP itself does
    t >= start_iter:   g <- compressed_allreduce(g_r, e_b)                  (op="mean")
                       = t_j sign(y_j) per served chunk j, where with worker error w_r
                         x'_r = g_r + w_r,  s_r = ||x'_r|| / sqrt(N),  w_r <- x'_r - s_r sign(x'_r)
                         y_j = (1/n) sum_r s_r sign(x'_r)[chunk j] + e_j,  t_j = ||y_j|| / sqrt(k_j),
                         e_j <- y_j - t_j sign(y_j)

with one `compcomm.ErrorFeedback` e_b (worker and server errors) per bucket. Error feedback makes
the sum over iterations of the averaged gradients equal the sum of the true averages up to the
errors still carried, which stay bounded; so any optimizer whose update is linear in the gradient
sum, momentum SGD above all, follows the uncompressed run closely (bench/train_step.py --plot
shows it). Adam is not such an optimizer: it divides by sqrt(v) built from the squares of the
communicated gradients, and 1-bit gradients have a very different second moment (every element
of a chunk has the same magnitude), so Adam behind this hook adapts to the compression noise
instead of the gradient. For Adam or LAMB use `compcomm.optim` (1-bit Adam / LAMB / 0/1 Adam),
which freeze the second moment after an uncompressed warm-up and compress the momentum instead.

Buckets: DDP puts every parameter in one bucket for the first iteration, then rebuilds its buckets
in the order gradients became ready. The state numbers parameters in the order it first sees them
(the same on every rank and in every run of the same model and DDP arguments) and keys each
bucket by its parameter numbers, so a bucket keeps its error feedback across iterations and
across the rebuild. A bucket made of buckets the state already knows (a freshly built DDP after a
checkpoint resume: one big bucket) is reduced as those known buckets, so a resumed run makes the
same collectives, bit for bit, as the run that never stopped; but for a state saved before DDP's
rebuild (after its first iteration, or first or second with static_graph), which knows only the
big bucket of before the rebuild, resumed into a run that compresses before its own DDP rebuilds
(its first iteration, or first two with static_graph): those iterations reduce that bucket
whole. A bucket that splits a known one (other DDP arguments) starts from zero errors. A state
from another model is refused at the first backward after the load, on every rank.

DDP's `join()`: a rank out of inputs runs the hook with zeros outside any backward; its
iteration ends at its last bucket, with `iter` kept where the ranks still training failed.
Reentrant activation checkpointing runs a checkpointed part's backward nested in the outer one:
its buckets belong to the outer backward, whose end ends the iteration.

Every collective goes through a compcomm backend in submission order, asynchronously: the hook
returns at once and the bucket is reduced while backward computes the next ones. Errors are
collective: a non-finite gradient (or another bad input) on any rank makes `loss.backward()`
raise on every rank alike, once the iteration's collectives are done, with the same
`compcomm.NonFiniteError` (or ValueError/TypeError) and no rank hangs; `except
compcomm.NonFiniteError` catches it, and its message names `nonfinite="propagate"`. A backward
that raises leaves no trace: no bucket's error feedback changes, also the buckets reduced before
the one that failed, and `iter` stays where it was, so a loop that catches the error and goes on
trains as if that backward never ran (except where it was DDP's first, after which DDP rebuilds
its buckets whatever happened: the next iteration then compresses with the rebuilt layout). For
that each bucket's new errors go into a second ErrorFeedback (`error_feedback_out`), which
replaces the bucket's only once every bucket of the iteration succeeded. The two alternate,
each holding one worker error: where an ErrorFeedback reduced in place keeps a second worker
buffer for its next x' anyway (`double_buffer`), this costs only a second server error, 1/n of
the bucket. In the uncompressed iterations the hook checks the averaged bucket, which is
identical on every rank, so the same holds there. The hook warns once if the optimizer that
steps its parameters divides by a second moment (Adam-like): see above.

Mixed precision: `torch.amp.GradScaler` expects an overflowing iteration's gradients to come back
non-finite, so that `scaler.step` skips it and lowers the scale. With `nonfinite="propagate"` a
bucket that fails with `NonFiniteError` (a NaN/Inf on some rank, or an average that would
overflow) is returned filled with NaN on every rank instead of raising; every rank then skips the
step alike. Other errors still raise. A skipped step leaves no trace in any error state, as a
raising backward leaves none, also in the buckets that were reduced before another one overflowed
(an overflow often appears only in the earlier layers); `iter` counts it, since the backward
completed. The carried errors are in the units of the scaled gradients: given the scaler
(`OnebitHookState(..., grad_scaler=scaler)`), the state rescales them whenever the scale changed
(a back-off, or growth every `growth_interval` steps), by the ratio of the scales, a power of two,
so that the run is bitwise the one whose loss was never scaled (as long as neither overflows nor
underflows). Without it, a change of scale applies to the new gradients and not to what is
carried: the errors carried across it count once too much or too little.
"""

import math
import warnings
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

from . import schedules
from .agreement import FLOAT_DTYPES, agreed_failure, raise_agreed
from .allreduce import compressed_allreduce
from .backends import Backend, check_backend_argument
from .backends.registry import falling_back, over_group
from .error_feedback import ErrorFeedback
from .errors import NonFiniteError, all_finite
from .gather_objects import agree_on_values, all_gather_object
from .layout import is_integer
from .loss_scale import ERRORS_SCALE, LossScale
from .optim.checkpoints import agree_on_position

__all__ = ["OnebitHookState", "onebit_hook"]

_ADAPTIVE = (torch.optim.Adagrad, torch.optim.RMSprop, torch.optim.Adadelta)

_FORMAT = "compcomm.ddp.OnebitHookState/1"
_NONFINITE = ("raise", "propagate")
Key = tuple[int, ...]


class _BackwardEnd:
    """The end of a backward, queued on autograd's engine: the queued callback alone holds it,
    so it is freed with a backward that stopped before its callbacks ran (an exception in it),
    and the state's weak reference to it then tells the next backward from a nested one."""


class OnebitHookState:
    """What `onebit_hook` carries between iterations: the iteration count, the parameters'
    numbering, and one ErrorFeedback per DDP bucket.

    `process_group`: the group DDP reduces over (pass the one you gave DDP; None is the default
    group). `start_iter`: iterations averaged uncompressed before the 1-bit stage begins.
    `backend`: the compcomm transport (a name such as "gloo", "nccl", "mpi", or a Backend, e.g.
    one over a sub-group); None builds gloo (CPU gradients) or nccl (CUDA) over `process_group`,
    and so does the name "gloo" or "nccl". A backend that a rank cannot build over
    `process_group` (over other ranks, a name that does not exist) is refused on every rank:
    at each backward, and in `load_state_dict` and `gathered_state_dict`.
    `nonfinite`: "raise" (backward raises NonFiniteError on every rank) or "propagate" (the
    bucket comes back as NaN on every rank, for GradScaler; see the module docstring).
    `grad_scaler`: the `torch.amp.GradScaler` whose scaled loss the backward runs on, if any: the
    carried errors then follow its scale (see the module docstring). Read once per compressed
    backward, at its first bucket (on CUDA a synchronization with the device).

    Checkpoints: `state_dict()` holds this rank's errors (save one file per rank);
    `gathered_state_dict()` (a collective) holds every rank's, for one file loaded by all ranks.
    """

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        start_iter: int = 10,
        backend: Backend | str | None = None,
        nonfinite: str = "raise",
        grad_scaler: torch.amp.GradScaler | None = None,
    ) -> None:
        if not is_integer(start_iter) or start_iter < 0:
            raise ValueError(f"start_iter must be an integer >= 0, got {start_iter!r}")
        if nonfinite not in _NONFINITE:
            raise ValueError(f"nonfinite must be one of {', '.join(map(repr, _NONFINITE))}, got {nonfinite!r}")
        check_backend_argument(backend)
        self._loss_scale = LossScale(grad_scaler)
        self.process_group = process_group
        self.start_iter = int(start_iter)  # a numpy integer would make the state dict's file unloadable
        self.nonfinite = nonfinite
        self.iter = 0
        self._backend_arg = backend
        self._backends: dict[str, Backend] = {}
        self._numbers: WeakIdKeyDictionary = WeakIdKeyDictionary()  # parameter -> its number
        self._numbered = 0  # numbers given: `_numbers` forgets freed parameters, their numbers stay taken
        self._params: list[tuple[tuple[int, ...], str]] = []  # number -> (shape, dtype)
        self._params_loaded = False  # `_params` came whole from a checkpoint: no parameter beyond them
        self._buckets: dict[Key, ErrorFeedback] = {}
        self._spares: dict[Key, ErrorFeedback] = {}  # key -> where its next errors go
        self._pending: list[Key] = []  # this iteration's errors in spares
        self._owner: dict[int, Key] = {}  # number -> its bucket's key
        self._in_flight: list[torch.futures.Future] = []  # this iteration's collectives
        self._backward: int | None = None  # autograd's id of the backward being reduced
        self._end: weakref.ref[_BackwardEnd] | None = None  # that backward's end, queued on autograd's engine
        self._iter_before: int = 0  # `iter` when that backward began: where a failed one leaves it
        self._failure: Exception | None = None  # what that backward must raise when it ends
        self._watched: set[int] | None = None  # ids of the parameters whose optimizer it waits to see
        self._optimizer_seen = False
        self._settings_agreed = False  # start_iter and nonfinite compared across ranks

    # ----------------------------------------------------------------- transport

    def backend(self, device: torch.device | None = None) -> Backend:
        """The compcomm backend that reduces buckets on `device`, built once per device type over
        `process_group` (`backends.registry.over_group`: the one given, or gloo / nccl)."""
        if device is None and self._backends:
            return next(iter(self._backends.values()))
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "compcomm.ddp.OnebitHookState reduces over DDP's process group, but torch.distributed is not "
                "initialized: call torch.distributed.init_process_group() first"
            )
        device = device or self._device()
        if device.type not in self._backends:
            self._backends[device.type] = over_group(
                self.process_group, self._backend_arg, device, "DDP's process group"
            )
        return self._backends[device.type]

    def _device(self) -> torch.device:
        return torch.device("cuda" if dist.get_backend(self.process_group) == "nccl" else "cpu")

    def _agreeing_backend(self, device: torch.device | None = None) -> tuple[Backend, Exception | None]:
        """`backend(device)` for a collective of the hook's, and the error it raised on this
        rank: then gloo or nccl over `process_group` (which every rank can build), over which
        the collective refuses it on every rank; raised here alone, it would leave the ranks
        whose backend is fine waiting for this one."""
        if self._backend_arg is None:
            return self.backend(device), None
        return falling_back(
            lambda: self.backend(device),
            lambda: over_group(self.process_group, None, device or self._device(), "DDP's process group"),
        )

    def _agree_on_settings(self, be: Backend, refused: Exception | None) -> Exception | None:
        """The error every rank refuses this backward with, or None: a backend that some rank
        could not build (`_agreeing_backend`), else settings that differ across ranks (one rank
        would reduce a bucket exactly while another sends it with 1 bit, and both wait). A
        failure of the transport itself is raised."""
        agreed = agreed_failure(refused, be, "OnebitHookState's backend: ")
        if agreed is not None:
            return agreed
        try:
            settings = {"start_iter": self.start_iter, "nonfinite": self.nonfinite}
            agree_on_values(
                {**settings, "grad_scaler": self.grad_scaler is not None},
                be,
                "OnebitHookState must be given the same settings on every rank (else one rank "
                "reduces a bucket exactly while another sends it with 1 bit, and both wait)",
            )
        except ValueError as exc:
            return exc
        return None

    # ----------------------------------------------------------------- bucket layout

    def _number(self, p: torch.Tensor) -> int:
        """The parameter's number (given in the order first seen), or a ValueError where the state
        belongs to another model: another shape or dtype at a number, or more parameters than
        a loaded state's. DDP checks that its ranks hold the same parameters, so every rank finds
        the same answer."""
        number = self._numbers.get(p)
        if number is None:
            number, self._numbered = self._numbered, self._numbered + 1
            self._numbers[p] = number
        if number >= len(self._params):
            if self._params_loaded or number > len(self._params):
                raise ValueError(
                    f"DDP handed more parameters than the {len(self._params)} of the model this hook state "
                    "was saved with: the state belongs to another model; resume with the same model and "
                    "DDP settings"
                )
            self._params.append((tuple(p.shape), str(p.dtype)))
        if self._params[number] != (tuple(p.shape), str(p.dtype)):
            raise ValueError(
                f"parameter {number} of this hook state is a {self._params[number]} tensor, but "
                f"DDP handed a {(tuple(p.shape), str(p.dtype))} one: the state belongs to another "
                "model (or DDP arguments); resume with the same model and DDP settings"
            )
        return number

    def _parts(self, params: list[torch.Tensor]) -> tuple[Key, list[Key]]:
        """The bucket's key and the known buckets it is reduced as: itself, or the known buckets
        that exactly make it up while they hold errors (laid out in their own order, so kept, at
        the price of gathering the bucket's pieces into them at each call). An unknown bucket
        becomes known; known ones it overlaps are dropped."""
        key = tuple(self._number(p) for p in params)
        if key in self._buckets:
            return key, [key]
        found = list(dict.fromkeys(self._owner.get(number) for number in key))
        owners = [k for k in found if k is not None]
        made_of_them = len(owners) == len(found) and sum(len(k) for k in owners) == len(key)
        if made_of_them and any(self._buckets[k].initialized for k in owners):
            return key, owners
        for old in owners:
            del self._buckets[old]
            self._spares.pop(old, None)
            for number in old:
                del self._owner[number]
        self._buckets[key] = ErrorFeedback()
        self._owner.update((number, key) for number in key)
        return key, [key]

    @property
    def grad_scaler(self) -> torch.amp.GradScaler | None:
        """The GradScaler whose scale the carried errors follow (None: unscaled gradients). Set
        at construction: the ranks compare it once, at the first backward."""
        return self._loss_scale.grad_scaler

    @property
    def error_feedback(self) -> dict[Key, ErrorFeedback]:
        """The error feedback of every known bucket, keyed by its parameters' numbers (a bucket's
        ErrorFeedback object alternates between two, its state and its spare, so look it up
        again after each iteration)."""
        return dict(self._buckets)

    # ----------------------------------------------------------------- checkpoints

    def state_dict(self) -> dict[str, Any]:
        """This rank's state (a copy): iteration, parameter shapes, per-bucket errors, and the
        rank and world size it belongs to (its errors are this rank's own)."""
        be = self.backend()
        buckets = []
        for key, ef in self._buckets.items():
            saved = ef.state_dict()
            buckets.append((list(key), {k: v.clone() if torch.is_tensor(v) else v for k, v in saved.items()}))
        return {
            "format": _FORMAT,
            "iter": self.iter,
            "start_iter": self.start_iter,
            ERRORS_SCALE: self._loss_scale.value,
            "rank": be.rank,
            "world_size": be.world_size,
            "params": [[list(s), d] for s, d in self._params],
            "buckets": buckets,
        }

    def gathered_state_dict(self) -> dict[str, Any]:
        """Every rank's `state_dict()` in one dict, on every rank (a collective: call it on all
        ranks, save it from one). `load_state_dict` of it gives each rank its own part."""
        be, refused = self._agreeing_backend()
        raise_agreed(refused, be, context="cannot gather the hook state: ")
        return {"format": _FORMAT, "world_size": be.world_size, "ranks": all_gather_object(self.state_dict(), be)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from `state_dict()` or `gathered_state_dict()` (a collective: call it on all
        ranks). Raises the same ValueError on every rank, changing nothing, if any rank's state
        cannot resume exactly: another world size, or another rank's errors (a per-rank state
        that holds no errors yet, saved during the first start_iter iterations, loads on any rank)."""
        be, failure = self._agreeing_backend()
        mine: tuple[int, int, list, dict[Key, ErrorFeedback], dict[str, Any]] | None = None
        try:
            mine = self._check(state, be) if failure is None else None
        except Exception as exc:  # reported to every rank, then raised everywhere
            failure = ValueError(f"{type(exc).__name__}: {exc}")
        raise_agreed(failure, be, context="cannot load the hook state: ")
        assert mine is not None  # else raised on every rank
        iteration, start_iter, params, buckets, scale = mine
        agree_on_position(  # per-rank files of other settings would compress on some ranks only
            {
                "iteration": iteration,
                "start_iter": start_iter,
                ERRORS_SCALE: scale.get(ERRORS_SCALE),
                "parameters": repr(params),
                "buckets": repr(list(buckets)),
            },
            be,
        )
        self.iter, self.start_iter, self._params = iteration, start_iter, params
        self._params_loaded = bool(params)
        if not params:  # a state saved before any backward knows no parameter: the numbering starts over
            self._numbers, self._numbered = WeakIdKeyDictionary(), 0
        self._loss_scale.load(scale)
        self._buckets, self._spares, self._pending = buckets, {}, []
        self._owner = {number: key for key in buckets for number in key}

    def _check(
        self, state: dict[str, Any], be: Backend
    ) -> tuple[int, int, list, dict[Key, ErrorFeedback], dict[str, Any]]:
        """Validate `state` for this rank and build what loading it sets; changes nothing."""
        if not isinstance(state, dict) or state.get("format") != _FORMAT:
            raise ValueError("not a compcomm.ddp.OnebitHookState state dict")
        if state.get("world_size") != be.world_size:
            raise ValueError(
                f"the state was saved on {state.get('world_size')} ranks, this group has "
                f"{be.world_size}: its error feedback belongs to another split of the buckets"
            )
        if "ranks" in state:
            state = state["ranks"][be.rank]
        buckets: dict[Key, ErrorFeedback] = {}
        for key, saved in state["buckets"]:
            ef = ErrorFeedback()
            ef.load_state_dict(saved)
            buckets[tuple(int(k) for k in key)] = ef
        if state["rank"] != be.rank and any(ef.initialized for ef in buckets.values()):
            raise ValueError(
                f"this is rank {state['rank']}'s state, loaded on rank {be.rank}: its error "
                "feedback is that rank's own. Save one file per rank, or one file with "
                "gathered_state_dict()"
            )
        params = [(tuple(int(x) for x in shape), str(dtype)) for shape, dtype in state["params"]]
        known = self._params[: len(params)]
        if known != params[: len(known)]:
            raise ValueError("the state's parameters do not match the ones this hook has seen: another model")
        counts = (state["iter"], state["start_iter"])
        if not all(is_integer(c) and c >= 0 for c in counts):
            raise ValueError(f"the state's iter and start_iter must be integers >= 0, got {counts}")
        _check_buckets(buckets, [math.prod(shape) for shape, _ in params], be)
        scale = {k: LossScale.saved(state[k]) for k in (ERRORS_SCALE,) if k in state}
        return int(state["iter"]), int(state["start_iter"]), params, buckets, scale

    # ----------------------------------------------------------------- the hook's work

    def reduce(self, bucket: dist.GradBucket) -> torch.futures.Future:
        """Start averaging `bucket` (as its known parts) and return a Future of its buffer.

        A bucket's future never fails: DDP would wrap its error in a RuntimeError and raise it
        while later buckets are still in flight. The iteration's last bucket waits for every
        collective of the iteration (they run in submission order) and notes the first error;
        a callback that the first bucket queued on the backward raises it, as itself (e.g.
        `compcomm.NonFiniteError`), once DDP has finished the backward.
        """
        buffer, params, last = bucket.buffer(), bucket.parameters(), bucket.is_last()
        be, refused = self._agreeing_backend(buffer.device)
        joined = self._watch_backward()
        if not self._settings_agreed:
            if self._failure is None:  # compared once per backward until they agree
                self._failure = self._agree_on_settings(be, refused)  # raised once DDP has finished
                self._settings_agreed = self._failure is None
            if not self._settings_agreed:  # refused: the buckets come back as they are, nothing sent
                return self._refused(buffer, last and joined)
        self._watch_optimizer(params)
        try:
            _check_bucket(buffer)
            key, parts = self._parts(params)
            if last and self._params_loaded and len(self._numbers) < len(self._params):
                raise ValueError(
                    f"DDP handed {len(self._numbers)} parameters, the model this hook state was saved with had "
                    f"{len(self._params)}: the state belongs to another model; resume with the same model and "
                    "DDP settings"
                )
        except (TypeError, ValueError) as exc:  # the same on every rank (DDP's buckets; see _number)
            return self._refuse(exc, buffer, last, joined)
        compress = self.iter >= self.start_iter
        if compress:
            self._loss_scale.follow(self._buckets.values())
        slices = _slices(params, parts, self._numbers)
        flats = [buffer if parts == [key] else torch.cat([buffer[a:b] for a, b in spans]) for spans in slices]
        try:
            if compress:
                outs = [self._spare(part) for part in parts]
                futures = [
                    compressed_allreduce(
                        flat, self._buckets[part], backend=be, async_op=True, error_feedback_out=out
                    ).get_future()
                    for flat, part, out in zip(flats, parts, outs)
                ]
            else:
                futures = [be.ordered(_uncompressed_mean, flat, be, async_op=True).get_future() for flat in flats]
        except Exception as exc:  # refused at submission (a channel a timed-out call broke): nothing sent
            return self._refuse(exc, buffer, last, joined)
        if compress:
            self._pending.extend(parts)
        if last:
            self.iter += 1
        # Futures of each collective's error (or None): they never fail, so collect_all (which
        # would complete at the first failure) waits for all of them.
        outcomes = [future.then(_failure) for future in futures]
        self._in_flight.extend(outcomes)
        waited, pending = outcomes, []
        if last:
            waited, self._in_flight = self._in_flight, []
            pending, self._pending = self._pending, []

        def finish(done: torch.futures.Future) -> torch.Tensor:
            failures = [outcome.value() for outcome in done.value()]
            for failed, flat, spans in zip(failures[len(failures) - len(futures) :], flats, slices):
                if failed is not None and self._propagates(failed):
                    for a, b in spans:
                        buffer[a:b].fill_(float("nan"))
                elif flat is not buffer and failed is None:
                    offset = 0
                    for a, b in spans:
                        buffer[a:b].copy_(flat[offset : offset + b - a])
                        offset += b - a
            if last and all(f is None for f in failures) and self._failure is None:
                self._keep(pending)  # else a bucket before was refused: no bucket's errors change
            first = next((f for f in failures if f is not None and not self._propagates(f)), None)
            if last and first is not None:
                self._failure = first  # the same error on every rank, raised when backward ends
            if last and joined:
                self._end_of_joined_iteration()
            return buffer

        return torch.futures.collect_all(waited).then(finish)

    def _watch_backward(self) -> bool:
        """At the first bucket of a backward, queue the callback that ends it. DDP queues its own
        (which waits for every bucket's future) only when the last bucket is ready, so ours
        queues the end from inside the queue: it then runs after DDP's.

        A bucket reduced in a backward nested in this one's (reentrant activation checkpointing
        runs the checkpointed part's backward inside a node of the outer one, as a graph task of
        its own) belongs to it: it comes while this backward's end is still queued. A backward
        that stopped on an exception before its end ran freed its queued end with it, so the
        next one starts afresh (`_BackwardEnd`).

        Outside any backward, DDP's `join()` is matching the collectives of the ranks still
        training, with zeros, for a rank out of inputs: that iteration begins at its first
        bucket too, but has no backward to raise from; its last bucket ends it
        (`_end_of_joined_iteration`). Returns whether this bucket is such a joined one."""
        task = torch._C._current_graph_task_id()
        joined = task < 0
        if joined:
            task = _JOINED
        if task != self._backward and (joined or self._end is None or self._end() is None):
            self._failure, self._iter_before = None, self.iter
            self._loss_scale.new_backward()
            if not joined:
                self._queue_end(_BackwardEnd())
        self._backward = task
        return joined

    def _queue_end(self, end: _BackwardEnd) -> None:
        """Queue `end` on the graph task running now, to run after DDP's own callback."""
        self._end = weakref.ref(end)
        engine = torch.autograd.Variable._execution_engine
        engine.queue_callback(lambda: engine.queue_callback(lambda: self._end_of_graph_task(end)))

    def _end_of_graph_task(self, end: _BackwardEnd) -> None:
        """The graph task `end` was queued on has finished. A task nested in a node of another
        (the checkpointed part's backward: that node is still running) hands `end` to the outer
        task once the node is done (its post hook runs in the outer task); the outermost ends the
        backward. Raising at a nested task's end would stop the outer backward before DDP saw its
        last buckets, which leaves DDP unusable."""
        node = torch._C._current_autograd_node()
        if node is not None:
            held = [end]  # given up at the first run: a graph kept with retain_graph runs it again
            node.register_hook(lambda grad_inputs, grad_outputs: self._hand_over(held))
            return
        self._end = None
        self._end_of_backward()

    def _hand_over(self, held: list[_BackwardEnd]) -> None:
        """Queue the end in `held` on the graph task running now, once, if it is still this
        state's backward's: the hook then holds it no longer, and the outer task alone does."""
        end = held.pop() if held else None
        if end is not None and self._end is not None and self._end() is end:
            self._queue_end(end)

    def _refuse(self, exc: Exception, buffer: torch.Tensor, last: bool, joined: bool) -> torch.futures.Future:
        """Refuse this iteration from this bucket on, with `exc` (unless it already failed): the
        bucket back as it is; at the last bucket, no earlier bucket's new errors are kept."""
        self._failure = self._failure or exc
        if last:
            self._in_flight, self._pending = [], []
        return self._refused(buffer, last and joined)

    def _refused(self, buffer: torch.Tensor, ends_joined: bool) -> torch.futures.Future:
        """The bucket back as it is, nothing sent: the iteration is refused on every rank alike
        (`_failure`, raised when the backward ends)."""
        if ends_joined:
            self._end_of_joined_iteration()
        untouched: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        untouched.set_result(buffer)
        return untouched

    def _end_of_joined_iteration(self) -> None:
        """End an iteration this rank joined with zeros (see `_watch_backward`): as a failed
        backward would, it leaves `iter` where it was if the iteration failed on every rank (the
        ranks still training raise); nothing is raised here, outside any backward."""
        self._backward = None
        failure, self._failure = self._failure, None
        if failure is not None:
            self.iter = self._iter_before

    def _end_of_backward(self) -> None:
        """Raise the iteration's error, if it had one, from `backward()` on every rank, with `iter`
        where it was before (its spares were not kept: see `reduce`)."""
        self._backward = None
        failure, self._failure = self._failure, None
        if failure is not None:
            self.iter = self._iter_before
        if isinstance(failure, NonFiniteError):
            raise NonFiniteError(
                f"{failure} [compcomm.ddp.onebit_hook: to skip such steps instead, as a GradScaler does, build "
                'the hook state with OnebitHookState(..., nonfinite="propagate")]'
            ) from failure
        if failure is not None:
            raise failure

    def _watch_optimizer(self, params: list[torch.Tensor]) -> None:
        """Look once at the optimizer that steps these parameters (through torch's global step
        pre-hook, since DDP never tells the hook which one) and warn if it divides by a second
        moment: 1-bit gradients have a second moment of their own, not the gradient's."""
        if self._watched is None and params and not self._optimizer_seen:
            self._watched = {id(p) for p in params}
            _watch(self)

    def _look_at(self, optimizer: torch.optim.Optimizer) -> None:
        """An optimizer is about to step: if it steps these parameters, the look is done."""
        if self._optimizer_seen or self._watched is None:
            return
        if not any(id(p) in self._watched for group in optimizer.param_groups for p in group["params"]):
            return
        self._optimizer_seen = True
        _WATCHING.discard(self)
        if "betas" in optimizer.defaults or isinstance(optimizer, _ADAPTIVE):
            warnings.warn(
                f"compcomm.ddp.onebit_hook feeds {type(optimizer).__name__} 1-bit gradients, whose second "
                "moment is not the gradient's: an optimizer that divides by it adapts to the compression "
                "noise. Use the hook with SGD (momentum), or compcomm.optim.OnebitAdam / OnebitLamb without "
                "DDP for Adam-like training",
                RuntimeWarning,
                stacklevel=3,
            )

    def _spare(self, key: Key) -> ErrorFeedback:
        """Where bucket `key`'s errors after this iteration go: a spare held until every bucket of
        the iteration succeeded on every rank (`_keep`)."""
        if key not in self._spares:
            self._spares[key] = ErrorFeedback()
        return self._spares[key]

    def _keep(self, keys: list[Key]) -> None:
        """The iteration succeeded everywhere: each bucket's spare becomes its error feedback."""
        for key in dict.fromkeys(keys):
            if key in self._buckets and key in self._spares:
                self._buckets[key], self._spares[key] = self._spares[key], self._buckets[key]

    def _propagates(self, failure: Exception) -> bool:
        """Whether `failure` comes back as a NaN bucket (nonfinite="propagate") instead of raising."""
        return self.nonfinite == "propagate" and isinstance(failure, NonFiniteError)


_WATCHING: weakref.WeakSet[OnebitHookState] = weakref.WeakSet()
"""The states still waiting to see their optimizer (weakly: a dropped state goes)."""
_looking: list[Any] = []  # the handle of `_look_at_optimizers`, once registered


def _watch(state: OnebitHookState) -> None:
    """Have `state` hear of every optimizer step until it has seen its own."""
    _WATCHING.add(state)
    if not _looking:
        _looking.append(register_optimizer_step_pre_hook(_look_at_optimizers))


def _look_at_optimizers(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """torch's global step pre-hook, registered once for every state: one hook in torch's dict
    for the life of the process, never removed (removing one while torch iterates over them
    fails its step), and it holds no state."""
    for state in list(_WATCHING):
        state._look_at(optimizer)


def onebit_hook(state: OnebitHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: the bucket's mean over ranks, uncompressed for the first
    `state.start_iter` iterations, then by the 1-bit allreduce with the bucket's error feedback."""
    return state.reduce(bucket)


def _slices(params: list[torch.Tensor], parts: list[Key], numbers: WeakIdKeyDictionary) -> list[list[tuple[int, int]]]:
    """For each part, the (start, end) element ranges of its parameters in the bucket's buffer."""
    where, offset = {}, 0
    for p in params:
        where[numbers[p]] = (offset, offset + p.numel())
        offset += p.numel()
    return [[where[number] for number in key] for key in parts]


def _check_buckets(buckets: dict[Key, ErrorFeedback], numels: list[int], be: Backend) -> None:
    """ValueError unless each saved bucket names parameters of the state's model, none twice, and
    its errors are those of the calls it makes here (its elements, over `be`'s ranks and layout):
    loaded, another bucket would fail every backward (or one rank's, and the others wait)."""
    serves, seen = schedules.serves(be), set[int]()
    for key, ef in buckets.items():
        if not key or any(not 0 <= k < len(numels) for k in key) or seen & set(key):
            raise ValueError(
                f"the state's bucket {list(key)} names parameters that are not among its model's {len(numels)}, "
                "or that another bucket names too"
            )
        seen |= set(key)
        why = ef.mismatch(*serves(sum(numels[k] for k in key)))
        if why is not None:
            raise ValueError(
                f"the state's bucket {list(key)} holds errors of other calls than it makes here "
                f"({why.split(';')[0]}): saved for other parameters, over another backend or another split of the ranks"
            )


def _check_bucket(buffer: torch.Tensor) -> None:
    """TypeError unless the 1-bit allreduce can take this bucket once `start_iter` is reached, so
    that such a model is refused at its first backward rather than after the warm-up."""
    if buffer.layout != torch.strided:
        raise TypeError(
            "compcomm.ddp.onebit_hook reduces dense gradients, and DDP handed it a bucket of sparse ones "
            "(an nn.Embedding(sparse=True)?): make them dense, or keep that module out of the hooked DDP model"
        )
    if buffer.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"compcomm.ddp.onebit_hook compresses float32, float16 or bfloat16 gradients from start_iter on, "
            f"and DDP handed it a bucket of {str(buffer.dtype).replace('torch.', '')} ones: train in one of those "
            "dtypes (refused from the first backward, not after the warm-up)"
        )


def _failure(future: torch.futures.Future) -> Exception | None:
    """The error a completed future holds, or None."""
    try:
        future.value()
    except Exception as exc:
        return exc
    return None


_JOINED = -2
"""`_backward` while DDP's join() runs the hook for a rank out of inputs (autograd's ids are >= 0)."""


def _uncompressed_mean(tensor: torch.Tensor, be: Backend) -> torch.Tensor:
    """sum_r (x_r * (1/n)), as DDP computes it; NonFiniteError on every rank if it is not finite
    (the sum is the same on every rank, so they all decide alike)."""
    tensor.mul_(1.0 / be.world_size)
    be.all_reduce(tensor, op="sum")
    if not all_finite(tensor):
        raise NonFiniteError("non-finite values (NaN/Inf) in some rank's gradients (or their sum overflowed)")
    return tensor

"""Persistent error-feedback state of one repeatedly reduced tensor."""

from __future__ import annotations

import math
import os
import sys
import threading
import warnings
import weakref
import zlib
from collections.abc import Mapping
from typing import Any

import torch

from . import codec
from .errors import largest_magnitude
from .layout import chunk_size, is_integer, padded_size

_KEYS = ("worker_error", "server_error", "numel", "world_size")
ALLREDUCE, REDUCE_SCATTER = "allreduce", "reduce_scatter"
LAYOUTS = (ALLREDUCE, REDUCE_SCATTER)
"""How the worker error lines up with the tensor. An allreduce pads the N elements at the end to
M = ceil(N / 8n) * 8n and keeps a server error of C = M / n; a reduce-scatter cuts the tensor into
n rows of L = N / n elements, each padded to ceil(L / 8) * 8 (also M in all), and keeps no server
error (each row has one owner, which decodes it exactly)."""
Served = tuple[int, int, str, int]
"""What an ErrorFeedback's calls serve: (elements, world size, layout, the rank whose errors
they are: this one's in the call's group, or among a composite's ranks, `CallSpec.owner`)."""


class ErrorFeedback:
    """The worker and server compression errors carried from one call to the next.

    `worker_error` (fp32, (M,)) holds what this rank's 1-bit code of its input left out;
    `server_error` (fp32, (C,)) what the code of its served chunk of the average left out (None
    for a reduce-scatter, which has no server side; see `LAYOUTS`). Both are None until the
    first successful call, which sizes them for its (numel, world size) and records its
    `layout` and the `rank` whose errors they are; using the instance for another numel,
    world size or collective, or on another rank (a state loaded from another rank's file), is a
    ValueError, because the carried errors would belong to other elements. Checkpoint it with
    `state_dict()`.

    `tag` names the reduced tensor in each call's header, so that ranks pairing different
    ErrorFeedbacks in one call (async calls submitted in different orders) raise a ValueError
    instead of mixing tensors. By default it is where the instance was created (function, line
    and column), which is the same on every rank of an SPMD program; pass a string where that is
    not enough (ErrorFeedbacks made in one loop share their site).

    `double_buffer` (default True): an allreduce in place keeps a second worker buffer of M fp32
    (allocated at the second such call), into which each call's scan writes the next state, so
    that no separate pass updates the worker error (see `worker_error`). False keeps one
    buffer, for one more pass over the errors per call.
    """

    def __init__(self, tag: str | None = None, double_buffer: bool = True) -> None:
        if tag is not None and not isinstance(tag, str):
            raise TypeError(
                f"ErrorFeedback's tag must be a string (or None: where it is made), got {type(tag).__name__}"
            )
        # (worker buffer, scale, real elements): the scale is None when the buffer holds e
        # itself, else the buffer holds x' for that many real elements (see `worker_error`).
        # One attribute, so that a reader on another thread never pairs one call's buffer with
        # another's scale or size.
        self._state: tuple[torch.Tensor | None, float | None, int] = (None, None, 0)
        self._spare: torch.Tensor | None = None  # the in-place call's next x' goes here
        self._spare_server: torch.Tensor | None = None  # a given-up server buffer, for reuse
        self.server_error: torch.Tensor | None = None
        self.numel: int | None = None
        self.world_size: int | None = None
        self.layout: str | None = None
        self.rank: int | None = None  # the rank whose errors these are (`CallSpec.owner`)
        self._server_max: float | None = None  # max |server_error|, valid while `_server_seen` says so
        self._server_seen: tuple[weakref.ref[torch.Tensor], int | None] | None = None
        self.double_buffer = double_buffer
        self.tag = tag if tag is not None else _creation_site(sys._getframe(1))
        # Where a user's code made it (its tag), while it has served at most one call: see
        # `DroppedInstances`.
        self._made_at: str | None = (
            self.tag if isinstance(self.tag, str) and not _inside_package(sys._getframe(1)) else None
        )
        self._calls = 0  # calls served while followed
        self._follow: dict[str, Any] | None = None  # what its finalizer reads, once followed

    @property
    def worker_error(self) -> torch.Tensor | None:
        """The worker error, fp32 (M,), or None before first use.

        A compressed allreduce keeps it in the x' form: the last call's v = x + e and its scale
        s, from which the next call's scan computes e = v - s sign(v) (0 on the padding) on the
        fly and writes its own v into a second buffer, so that no pass of its own updates the
        error. Reading this attribute in that form computes e (one pass) into a new tensor, with
        the bits the update would have given: reading changes nothing, and the values are those
        of this moment (a later call may write over a buffer read earlier)."""
        worker, scale, real = self._state
        if worker is None or scale is None:
            return worker
        errors = torch.empty_like(worker)
        codec.codec_for(worker.device).error_update_(worker, scale, real, out=errors)
        return errors

    @worker_error.setter
    def worker_error(self, value: torch.Tensor | None) -> None:
        self._state = (value, None, 0)

    @property
    def _worker(self) -> torch.Tensor | None:
        return self._state[0]

    def _materialize_(self) -> None:
        """Turn the x' form back into e in place (a call that updates e itself, after its verdict)."""
        worker, scale, real = self._state
        if worker is not None and scale is not None:
            codec.codec_for(worker.device).error_update_(worker, scale, real)
            self._state = (worker, None, 0)

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        follow = self.__dict__.get("_follow")
        if follow is not None and name in follow:
            follow[name] = value

    def __getstate__(self) -> dict[str, Any]:
        """The errors and what they belong to, without the scratch buffers: a copy or a pickle
        starts with none (a `copy.copy` sharing the spare let two instances write one buffer),
        nor with the original's record as a followed instance (`DroppedInstances`)."""
        return {**self.__dict__, "_spare": None, "_spare_server": None, "_follow": None, "_server_seen": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Unpickle, also an instance pickled by an earlier version: `worker_error` a plain
        attribute (0.1.0 had no tag, layout or server maximum either), or the x' form kept as
        `_worker` and `_pending_scale`, or as a (buffer, scale) pair."""
        state = dict(state)
        if "worker_error" in state:
            state["_state"] = (state.pop("worker_error"), None, 0)
        elif "_worker" in state:
            scale = state.pop("_pending_scale", None)
            state["_state"] = (state.pop("_worker"), scale, state.get("numel") or 0)
        elif len(state.get("_state", ())) == 2:  # (buffer, scale): the size was not kept with them
            state["_state"] = (*state["_state"], state.get("numel") or 0)
        held = state.get("_state", (None, None, 0))[0] is not None
        defaults: dict[str, Any] = {
            "_state": (None, None, 0),
            "server_error": None,
            "numel": None,
            "world_size": None,
            "layout": ALLREDUCE if held else None,
            "rank": None,
            "_server_max": None,
            "double_buffer": True,
            "tag": "",
        }
        self.__dict__.update(
            {**defaults, **state, "_spare": None, "_spare_server": None, "_follow": None, "_server_seen": None}
        )

    def worker_form(self, device: torch.device) -> tuple[torch.Tensor | None, float | None]:
        """What a scan reads the worker error from, on `device`, as it is held: (the buffer, None)
        for e itself, (the buffer, s) for the x' form (see `worker_error`), (None, None) before
        first use. Changes nothing."""
        worker, scale, _ = self._state
        return (None if worker is None else worker.to(device)), scale

    def held_buffers(self) -> list[torch.Tensor]:
        """The tensors this instance holds: its errors and the buffers it keeps for the next
        call (the x' form's second buffer, a given-up server buffer)."""
        buffers = (self._worker, self.server_error, self._spare, self._spare_server)
        return [t for t in buffers if t is not None]

    @property
    def nbytes(self) -> int:
        """The memory `held_buffers` take."""
        held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in self.held_buffers()}
        return sum(held.values())

    @property
    def initialized(self) -> bool:
        """Whether a call (or `load_state_dict`) has sized the errors yet."""
        return self._worker is not None

    @property
    def fingerprint(self) -> int:
        """A 32-bit digest of `tag`, carried in every call's header."""
        return zlib.crc32(self.tag.encode())

    def mismatch(self, numel: int, world_size: int, layout: str = ALLREDUCE, rank: int | None = None) -> str | None:
        """Why this state cannot serve a call of (numel, world_size) with `layout` on `rank`
        (None: any rank), or None if it can."""
        if not self.initialized:
            return None
        if (self.numel, self.world_size, self.layout) == (numel, world_size, layout):
            if rank is not None and self.rank is not None and self.rank != rank:
                return (
                    f"this ErrorFeedback holds the errors of rank {self.rank}, not of rank {rank}: each rank "
                    "carries its own errors, so a state saved or used on another rank does not serve this one; "
                    "load this rank's own state_dict() (one file per rank) or reset() it"
                )
            return self._unfit_buffer(numel, world_size, layout)
        if self.layout != layout:
            return (
                f"this ErrorFeedback holds the errors of a compressed {self.layout}, not of a {layout}; "
                "use one ErrorFeedback per reduced tensor and collective (or reset() it)"
            )
        return (
            f"this ErrorFeedback holds errors of a {self.numel}-element tensor over "
            f"{self.world_size} ranks, not {numel} elements over {world_size}; use one "
            "ErrorFeedback per reduced tensor (or reset() it). Over a hierarchical backend an "
            "ErrorFeedback holds this rank's part of the tensor over the nodes, so one used there "
            "serves no flat call of the same tensor, nor the reverse"
        )

    def _unfit_buffer(self, numel: int, world_size: int, layout: str) -> str | None:
        """Why a held error buffer cannot be this state's, or None: `worker_error` and
        `server_error` are attributes a caller may assign, and the codec reads and writes them
        as dense fp32 arrays of the sizes the first call gave them."""
        server_shape = None if layout == REDUCE_SCATTER else (chunk_size(numel, world_size),)
        for name, held, shape in (
            ("worker_error", self._worker, (padded_size(numel, world_size),)),
            ("server_error", self.server_error, server_shape),
        ):
            if shape is None and held is None:
                continue
            if shape is None:
                return f"this ErrorFeedback holds a server_error, which a {layout} has none of; reset() it"
            if not (isinstance(held, torch.Tensor) and _fits(held, shape, held.device, set())):
                return (
                    f"this ErrorFeedback's {name} is {_held(held)}, where its calls of {numel} elements over "
                    f"{world_size} ranks need a contiguous fp32 tensor of shape {shape}: assign errors of that "
                    "shape, load_state_dict() a saved state, or reset() it"
                )
        return None

    def server_error_max(self) -> float:
        """max |server_error| (0 before first use): bounds the next server sum in phase 0, and
        finds a NaN or Inf in it. The value the last update measured serves while the attribute
        holds the tensor it was measured on, unchanged since (torch's version counter): a
        server error assigned or changed in place by the caller is measured again (one pass)."""
        if self.server_error is None:
            return 0.0
        known = self._known_server_max()
        if known is None:
            self.record_server_max()
            known = self._server_max
        assert known is not None
        return known

    def record_server_max(self, peak: float | None = None) -> None:
        """Record max |server_error| after the algorithm updated it: `peak`, as the update measured
        it while writing, or else measured here (one pass over C elements)."""
        assert self.server_error is not None
        self._note_server_max(largest_magnitude(self.server_error) if peak is None else peak)

    def _note_server_max(self, value: float | None) -> None:
        """`value` is max |server_error| as the tensor is now (None: not known)."""
        server = self.server_error
        self._server_max = value
        self._server_seen = None if value is None or server is None else (weakref.ref(server), _version(server))

    def _known_server_max(self) -> float | None:
        """The recorded max |server_error|, if the attribute still holds the tensor it was
        recorded for, unchanged since; else None."""
        server, seen = self.server_error, self._server_seen
        if self._server_max is None or server is None or seen is None:
            return None
        if seen[0]() is not server or seen[1] is None or seen[1] != _version(server):
            return None
        return self._server_max

    def buffers(
        self, numel: int, world_size: int, device: torch.device, layout: str = ALLREDUCE
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The (worker, server) error tensors on `device`, allocated as zeros on first use (no
        server error for a reduce-scatter)."""
        if self._worker is None:
            self.worker_error = torch.zeros(padded_size(numel, world_size), dtype=torch.float32, device=device)
            self.server_error = _server_zeros(numel, world_size, device, layout)
            self.numel, self.world_size, self.layout = numel, world_size, layout
            self._note_server_max(0.0)
        else:
            self._to(device)
            self._materialize_()
        worker = self._worker
        assert worker is not None
        return worker, self.server_error

    def _to(self, device: torch.device) -> None:
        """Move the errors to `device` (the x' form stays as it is)."""
        worker, scale, real = self._state
        if worker is not None and worker.device != device:
            self._state = (worker.to(device), scale, real)
            self.server_error = None if self.server_error is None else self.server_error.to(device)
            self._spare = self._spare_server = None

    def scan_writes_x_prime(self, source: ErrorFeedback) -> bool:
        """Whether an allreduce from `source`'s errors into this instance writes its new x'
        during its scan (`next_x_prime_buffer` gives a buffer): always into another
        ErrorFeedback, in place when `double_buffer`."""
        return self is not source or self.double_buffer

    def next_x_prime_buffer(
        self, source: ErrorFeedback, numel: int, world_size: int, device: torch.device
    ) -> torch.Tensor | None:
        """Where an allreduce from `source`'s errors into this instance writes its new x'
        during its scan, before the verdict: a buffer of M fp32 that shares no memory with
        `source`'s errors; None when there is none to write into (the call then updates the
        errors in a pass of its own, after the verdict).

        In place (`source` is self), it is a second buffer kept for the purpose, when
        `double_buffer`: that costs the tensor's fp32 size once more per ErrorFeedback, and
        saves a pass over 3 x 4 bytes per element per call. Into another ErrorFeedback (an
        `error_feedback_out`), it is that one's own buffer: it gives up its errors now, so a
        call rejected afterwards leaves it holding none (its server buffer is kept for reuse)."""
        shape = (padded_size(numel, world_size),)
        theirs = codec.storages(source._worker, source.server_error)
        if not self.scan_writes_x_prime(source):
            return None
        if self is source:
            if not _fits(self._spare, shape, device, theirs):
                self._spare = torch.empty(shape, dtype=torch.float32, device=device)
            return self._spare
        theirs |= codec.storages(source._spare)  # copy.copy shares it: the source's next in-place x' goes there
        buffer = next((t for t in (self._worker, self._spare) if _fits(t, shape, device, theirs)), None)
        server = self.server_error if self.server_error is not None else self._spare_server
        self.reset()
        self._spare_server = server
        return buffer if buffer is not None else torch.empty(shape, dtype=torch.float32, device=device)

    def take_x_prime(
        self, source: ErrorFeedback, x_prime: torch.Tensor, scale: float, numel: int, world_size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """After the verdict, the call's errors become this instance's: the worker error in the
        x' form (`x_prime`, from `next_x_prime_buffer`, with this rank's scale), and the server
        error, which the call goes on to write. Returns (the server error to write, the server
        error before the call to read): the same tensor in place; into another ErrorFeedback,
        this one's own buffer and `source`'s errors, which the server pass reads where they lie
        (`Codec.server_scan_`'s `previous`), so keeping the old state costs no copy of them."""
        device, server_shape = x_prime.device, (chunk_size(numel, world_size),)
        if self is source:
            if self._worker is None:
                self.server_error = _server_zeros(numel, world_size, device, ALLREDUCE)
                self.numel, self.world_size, self.layout = numel, world_size, ALLREDUCE
            self._to(device)
            self._spare = self._worker
            previous = self.server_error
        else:
            server = self._spare_server
            if server is None or not _fits(server, server_shape, device, codec.storages(source.server_error)):
                server = torch.empty(server_shape, dtype=torch.float32, device=device)
            if source.server_error is None:
                previous = server.zero_()
            else:
                previous = source.server_error.to(device)
            self.server_error, self._spare_server = server, None
            self.tag, self.numel, self.world_size, self.layout = source.tag, numel, world_size, ALLREDUCE
        self._state = (x_prime, scale, numel)
        self._server_max = None
        assert self.server_error is not None and previous is not None
        return self.server_error, previous

    def follow(
        self, source: ErrorFeedback, numel: int, world_size: int, device: torch.device, layout: str = ALLREDUCE
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Take over the errors of a call that starts from `source`'s and leaves `source` as it
        is: (worker error to read, server error to update in place, worker error to write).
        The call writes the worker error into this instance's buffer, reused when it fits (and
        shares no memory with `source`'s, e.g. after `copy.copy`), so keeping the old state
        costs no copy of it; only the server error (C of the M elements) is copied. Whatever
        this instance held is replaced, its tag too (it takes `source`'s). With `source`
        itself, `buffers()`, in place."""
        if source is self:
            worker, server = self.buffers(numel, world_size, device, layout)
            return worker, server, worker
        old_worker, old_server = source.worker_error, source.server_error
        server_shape = None if layout == REDUCE_SCATTER else (chunk_size(numel, world_size),)
        self._own_buffers((padded_size(numel, world_size),), server_shape, device, source)
        assert self.worker_error is not None
        if old_worker is None:  # source unused: the errors start at zero
            self.worker_error.zero_()
            if self.server_error is not None:
                self.server_error.zero_()
            old_worker = self.worker_error
        else:
            if self.server_error is not None and old_server is not None:
                self.server_error.copy_(old_server.to(device))
            old_worker = old_worker.to(device)
        self.tag, self.numel, self.world_size, self.layout = source.tag, numel, world_size, layout
        self._server_max = None
        return old_worker, self.server_error, self.worker_error

    def clone(self) -> ErrorFeedback:
        """An independent copy (same tag, buffers cloned): work on it, keep it if the work succeeds."""
        return ErrorFeedback(tag=self.tag, double_buffer=self.double_buffer).copy_(self)

    def copy_(self, source: ErrorFeedback) -> ErrorFeedback:
        """Become an independent copy of `source` (as `source.clone()`), writing into this
        instance's own buffers where they fit: a step that works on a copy every call then
        allocates nothing (on a CPU, fresh memory costs a page fault per 4 KiB). Returns self."""
        if source is self:
            return self
        self.tag = source.tag
        worker, scale, real = source._state
        if worker is None:
            self.reset()
            return self
        server_shape = None if source.server_error is None else tuple(source.server_error.shape)
        self._own_buffers(tuple(worker.shape), server_shape, worker.device, source)
        mine = self._worker
        assert mine is not None
        mine.copy_(worker)
        self._state = (mine, scale, real)  # the same form as the source's
        if self.server_error is not None and source.server_error is not None:
            self.server_error.copy_(source.server_error)
        self.numel, self.world_size, self.layout = source.numel, source.world_size, source.layout
        self.rank = source.rank
        self._note_server_max(source._known_server_max())
        return self

    def _own_buffers(
        self,
        worker_shape: tuple[int, ...],
        server_shape: tuple[int, ...] | None,
        device: torch.device,
        source: ErrorFeedback,
    ) -> None:
        """fp32 error buffers of these shapes on `device` (contents unspecified; no server error
        when `server_shape` is None): the present ones where they fit and share no memory with
        `source`'s (e.g. after `copy.copy`), else new; a spare shared with `source` is dropped
        (`source`'s next in-place call may write into any of its buffers)."""
        theirs = codec.storages(source._worker, source.server_error, source._spare)
        if codec.storages(self._spare) & theirs:
            self._spare = None
        server_fits = (
            self.server_error is None
            if server_shape is None
            else _fits(self.server_error, server_shape, device, theirs)
        )
        if not (_fits(self._worker, worker_shape, device, theirs) and server_fits):
            self.worker_error = torch.empty(worker_shape, dtype=torch.float32, device=device)
            self.server_error = (
                None if server_shape is None else torch.empty(server_shape, dtype=torch.float32, device=device)
            )
        self._state = (self._worker, None, 0)

    def rescale_(self, factor: float) -> None:
        """Multiply the carried errors by `factor` > 0: what they are in new units, e.g. after a
        loss scale changed from s to s * factor. The code is scale-equivariant (signs unchanged,
        scales proportional), so with a power of two, as GradScaler's steps are, the next calls
        give bitwise what they would have given had the inputs always been in the new units."""
        if not (math.isfinite(factor) and factor > 0):
            raise ValueError(f"rescale_ takes a finite factor > 0, got {factor!r}")
        worker, scale, real = self._state
        if worker is not None:
            worker.mul_(factor)
            self._state = (worker, None if scale is None else scale * factor, real)
        known = self._known_server_max()
        if self.server_error is not None:
            self.server_error.mul_(factor)
        self._note_server_max(None if known is None else known * factor)

    def reset(self) -> None:
        """Forget the carried errors (the next call starts from zero)."""
        self.worker_error = self.server_error = None
        self.numel = self.world_size = self.layout = self.rank = None
        self._server_max = None
        self._spare = self._spare_server = None

    def state_dict(self) -> dict[str, Any]:
        """This rank's errors and what they belong to: `worker_error`, `server_error`, `numel`,
        `world_size`, `rank` (and `layout` for a reduce-scatter). They differ across ranks: save
        one file per rank (another rank's state loads, and its next call is refused on every
        rank). The tensors hold this moment's values, which a later call may write over: save
        them (or clone them) before the next call."""
        state: dict[str, Any] = {
            "worker_error": self.worker_error,
            "server_error": self.server_error,
            "numel": self.numel,
            "world_size": self.world_size,
            "rank": self.rank,
        }
        if self.layout == REDUCE_SCATTER:
            state["layout"] = REDUCE_SCATTER
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore errors saved by `state_dict()`; they are moved to the tensor's device on use.

        A ValueError, with this instance unchanged, for anything `state_dict()` cannot have
        produced: missing keys, tensors of another shape or rank or not floating point,
        non-finite values, non-zero padding, a negative rank. Floating-point
        errors of another dtype are converted to fp32 (a float64 value beyond fp32's range is
        refused). A never-used instance's state (all None) resets this one. A state without a
        `rank` (saved before states recorded it) serves any rank.
        """
        if not isinstance(state, Mapping) or any(key not in state for key in _KEYS):
            raise ValueError(
                f"ErrorFeedback state must be a dict with the keys {', '.join(_KEYS)} "
                f"(as state_dict() returns), got {_describe(state)}"
            )
        worker, server, numel, world = (state[key] for key in _KEYS)
        if worker is None and server is None and numel is None and world is None:
            self.reset()
            return
        layout = state.get("layout", ALLREDUCE)
        if layout not in LAYOUTS:
            raise ValueError(f"ErrorFeedback state: layout must be one of {LAYOUTS}, got {layout!r}")
        numel, world = _count("numel", numel, 0), _count("world_size", world, 1)
        rank = state.get("rank")
        if rank is not None and not (is_integer(rank) and rank >= 0):
            raise ValueError(f"ErrorFeedback state: rank must be None or an integer >= 0, got {rank!r}")
        worker = _error_tensor("worker_error", worker, padded_size(numel, world))
        if layout == REDUCE_SCATTER:
            if numel % world:
                raise ValueError(f"ErrorFeedback state: a reduce-scatter's numel {numel} is not a multiple of {world}")
            if server is not None:
                raise ValueError("ErrorFeedback state: a reduce-scatter's state holds no server_error")
            padding = worker.view(world, -1)[:, numel // world :]
        else:
            server = _error_tensor("server_error", server, chunk_size(numel, world))
            padding = worker[numel:]
        if bool(padding.any()):
            raise ValueError("ErrorFeedback state: worker_error is not zero on the padding")
        self.worker_error, self.server_error = worker, server
        self.numel, self.world_size, self.layout, self._server_max = numel, world, layout, None
        self.rank = None if rank is None else int(rank)


def _fits(t: object, shape: tuple[int, ...], device: torch.device, avoid: set[int]) -> bool:
    """Whether `t` is a dense fp32 buffer of `shape` on `device` sharing no memory with `avoid`
    (the codec reads and writes the errors as such arrays)."""
    return (
        isinstance(t, torch.Tensor)
        and t.layout == torch.strided
        and tuple(t.shape) == shape
        and t.device == device
        and t.dtype == torch.float32
        and t.is_contiguous()
        and not codec.storages(t) & avoid
    )


def _server_zeros(numel: int, world_size: int, device: torch.device, layout: str) -> torch.Tensor | None:
    if layout == REDUCE_SCATTER:
        return None
    return torch.zeros(chunk_size(numel, world_size), dtype=torch.float32, device=device)


class DroppedInstances:
    """Warns, once per place in the user's code, when `REPEATS` ErrorFeedbacks made there for as
    many elements each served one successful call and were dropped: the mistake of a new
    instance per call (`compressed_allreduce(t, ErrorFeedback())` in a loop), which runs and
    averages but carries no error from one call to the next, so what the 1-bit code leaves out
    is lost instead of fed back. An instance that serves several calls (kept, one per tensor or
    per run of a sweep), one whose call failed, and the library's own are not counted.

    It never raises: a warning turned into an error (-W error) is written to stderr instead,
    since it would reach one rank before the agreement that the others wait in."""

    REPEATS = 3
    KEEP = 4096  # places x sizes followed at most (a program making tensors of ever new sizes)

    def __init__(self) -> None:
        self._lock = threading.RLock()  # a finalizer may run inside a locked section (garbage collection)
        self._dropped: dict[tuple[str, int], int] = {}
        self._warned: set[str] = set()

    def count_call(self, ef: ErrorFeedback, numel: int) -> None:
        """Note a call that `ef` serves (on `numel` elements), if a user's code made it."""
        site = getattr(ef, "_made_at", None)
        if site is None:
            return
        ef._calls = getattr(ef, "_calls", 0) + 1
        if ef._calls > 1:  # it serves several calls: not the mistake, no longer followed
            ef._made_at = None
            return
        # What the finalizer reads when the instance goes: a record of its own, which the
        # instance keeps up to date (`__setattr__`). Given the instance's dict instead, the
        # finalizer (a root) would keep alive whatever that dict leads to, the instance too.
        ef._follow = {"_made_at": site, "numel": ef.numel}
        weakref.finalize(ef, self._gone, (site, numel), ef._follow).atexit = False
        with self._lock:
            dropped = self._dropped.get((site, numel), 0)
            warn = dropped >= self.REPEATS and site not in self._warned
            if warn:
                self._warned.add(site)
        if warn:
            _warn_safely(
                f"compcomm: an ErrorFeedback made at {site} starts from zero, and {dropped} earlier ones made "
                f"there for {numel} elements each served one call and were dropped. A new ErrorFeedback per "
                "call carries no error from one call to the next: the 1-bit code's errors are lost instead of "
                "fed back. Make it once, outside the loop, and pass the same instance to every call "
                "(checkpoint it with state_dict()); to start over on purpose, call its reset(). (Shown once "
                "per place.)"
            )

    def _gone(self, key: tuple[str, int], fields: dict[str, Any]) -> None:
        """An instance followed since its first call was collected: counted if that call, its
        only one, succeeded (its `numel` set)."""
        if fields.get("_made_at") is None or fields.get("numel") is None:
            return
        with self._lock:
            if len(self._dropped) >= self.KEEP and key not in self._dropped:
                self._dropped.clear()
            self._dropped[key] = self._dropped.get(key, 0) + 1


def _warn_safely(message: str) -> None:
    try:
        warnings.warn(message, RuntimeWarning, stacklevel=5)
    except Exception:  # a filter turned it into an error: raised here it would hang the other ranks
        print(f"RuntimeWarning: {message}", file=sys.stderr)


DROPPED = DroppedInstances()


def _inside_package(frame: Any) -> bool:
    """Whether a frame runs compcomm's own code (whose instances `DroppedInstances` leaves alone)."""
    where = os.path.abspath(frame.f_code.co_filename)
    return os.path.commonpath([where, _PACKAGE_DIR]) == _PACKAGE_DIR


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def _creation_site(frame: Any) -> str:
    """file:function:line:column of a call, stable across ranks, paths and Python builds."""
    code = frame.f_code
    column = None
    if hasattr(code, "co_positions"):
        positions = list(code.co_positions())
        index = frame.f_lasti // 2
        if 0 <= index < len(positions):
            column = positions[index][2]
    return f"{os.path.basename(code.co_filename)}:{code.co_name}:{frame.f_lineno}:{column}"


def _held(value: Any) -> str:
    """An error buffer as a message names it."""
    if not isinstance(value, torch.Tensor):
        return type(value).__name__
    layout = "" if value.layout == torch.strided and value.is_contiguous() else f" ({value.layout}, not contiguous)"
    return f"a {value.dtype} tensor of shape {tuple(value.shape)}{layout}"


def _describe(value: Any) -> str:
    if isinstance(value, Mapping):
        return f"a dict with keys {sorted(map(str, value))}"
    return type(value).__name__


def _count(name: str, value: Any, low: int) -> int:
    if not is_integer(value) or value < low:
        raise ValueError(f"ErrorFeedback state: {name} must be an integer >= {low}, got {value!r}")
    return int(value)


def _error_tensor(name: str, value: Any, length: int) -> torch.Tensor:
    """A validated fp32 copy of a saved error buffer."""
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"ErrorFeedback state: {name} must be a tensor, got {type(value).__name__}")
    if not value.is_floating_point():
        raise ValueError(f"ErrorFeedback state: {name} must be a float tensor, got {value.dtype}")
    if tuple(value.shape) != (length,):
        raise ValueError(
            f"ErrorFeedback state: {name} has shape {tuple(value.shape)}; shapes that do not fit "
            f"the saved numel and world_size (needs ({length},))"
        )
    if value.layout != torch.strided:
        raise ValueError(f"ErrorFeedback state: {name} must be a dense tensor, got layout {value.layout}")
    if value.device.type == "meta":
        raise ValueError(f"ErrorFeedback state: {name} is on the meta device and holds no values")
    copy = value.detach().to(torch.float32).clone()  # values beyond fp32's range become inf: rejected
    if not bool(torch.isfinite(copy).all()):
        raise ValueError(f"ErrorFeedback state: {name} holds NaN or Inf (or values beyond fp32's range)")
    return copy


def _version(tensor: torch.Tensor) -> int | None:
    """torch's count of the in-place changes to `tensor` (None for an inference tensor, which
    keeps none)."""
    try:
        return tensor._version
    except RuntimeError:
        return None

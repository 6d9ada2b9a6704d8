"""Which gradients are ready during backward: the signal the optimizers' overlap runs on.

A post-accumulate-grad hook on every parameter reports, in the order autograd finishes
them, that the parameter's `.grad` now holds this backward's (accumulated) gradient; the
first report of a backward queues a callback that autograd runs once the whole backward is
done. Outside `with paused():` (the optimizer's `no_sync`), both are forwarded to the owner.

Reentrant activation checkpointing differentiates each region in a backward of its own, which
autograd runs nested in the one that reached it: a callback queued there runs at the nested
one's end, while the outer backward still has gradients to make. Such an end is reported apart
(`nested_done`); the outer backward's next gradient queues the callback again, in the outer
backward (if none comes, the optimizer's step finds that no backward ended, as after a missed
one).

A parameter reports to the newest Readiness built on it (an optimizer replacing another takes
its parameters over when it is built, on every rank alike); the hooks hold their Readiness
weakly, so that a dropped optimizer can be collected.
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from collections.abc import Callable, Iterator, Sequence
from types import FrameType

import torch
from torch.autograd.function import BackwardCFunction
from torch.utils.hooks import RemovableHandle
from torch.utils.weak import WeakIdKeyDictionary

_PYTHON_NODE = BackwardCFunction.apply.__code__  # how autograd runs a Python Function's backward


def in_nested_backward() -> bool:
    """Whether this runs inside a backward that autograd runs nested in another: one started from
    a Python autograd Function's backward (reentrant checkpointing's), whose frame is then below
    this one on the thread's stack, as it never is at the end of a backward started otherwise."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _PYTHON_NODE:
            return True
        frame = frame.f_back
    return False


class Readiness:
    """Forwards `ready(i)` (parameter i's gradient is accumulated) and `done()` (the backward
    finished) to the owner, and remembers the order in which parameters first became ready."""

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        ready: Callable[[int], None],
        done: Callable[[], None],
        nested_done: Callable[[], None] | None = None,
    ) -> None:
        self._ready, self._done, self._nested_done = ready, done, nested_done
        self.order: list[int] = []
        self._seen: set[int] = set()
        self._queued = False
        self._paused = False
        self._handles: dict[int, RemovableHandle] = {}
        for i, p in enumerate(params):
            if p.requires_grad:
                _take_over(p, self)
                self._handles[id(p)] = p.register_post_accumulate_grad_hook(_hook(weakref.ref(self), i))
        weakref.finalize(self, _remove, self._handles)

    def _report(self, i: int) -> None:
        if i not in self._seen:
            self._seen.add(i)
            self.order.append(i)
        if self._paused:
            return
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        self._ready(i)

    def _finish(self) -> None:
        self._queued = False
        if not in_nested_backward():
            self._done()
        elif self._nested_done is not None:
            self._nested_done()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Gradients accumulate in `.grad` without reports (nesting is allowed)."""
        before, self._paused = self._paused, True
        try:
            yield
        finally:
            self._paused = before


def _hook(readiness: weakref.ref[Readiness], i: int) -> Callable[[torch.Tensor], None]:
    """Parameter i's hook. It holds its Readiness weakly: torch keeps a parameter's
    post-accumulate-grad hooks where the garbage collector does not look, so a hook holding its
    owner would keep the owner, its optimizer and their state (and through them the parameters)
    alive for the life of the process."""

    def hook(_: torch.Tensor) -> None:
        owner = readiness()
        if owner is not None:
            owner._report(i)

    return hook


_REPORTS_TO: WeakIdKeyDictionary = WeakIdKeyDictionary()
"""Each parameter's Readiness (weakly): the newest one built on it, the only one it reports to."""


def _take_over(param: torch.Tensor, readiness: Readiness) -> None:
    """`param` reports to `readiness` from now on. An older Readiness on it (an optimizer that
    this one replaces: `opt = OnebitAdam(...)` again) stops hearing from it here, at a point
    that every rank reaches alike, rather than whenever each rank's garbage collector frees the
    old optimizer: until then its hooks would start its own collectives on some ranks only."""
    older = _REPORTS_TO.get(param)
    replaced = older() if older is not None else None
    if replaced is not None:
        handle = replaced._handles.pop(id(param), None)
        if handle is not None:
            handle.remove()
    _REPORTS_TO[param] = weakref.ref(readiness)


def _remove(handles: dict[int, RemovableHandle]) -> None:
    """Unregister the hooks (when their Readiness is collected)."""
    for handle in handles.values():
        handle.remove()
    handles.clear()

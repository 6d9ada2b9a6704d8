"""Which gradients are ready during backward: the signal the optimizers' overlap runs on.

A post-accumulate-grad hook on every parameter reports, in the order autograd finishes
them, that the parameter's `.grad` now holds this backward's (accumulated) gradient; the
first report of a backward queues a callback that autograd runs once the whole backward is
done. Outside `with paused():` (the optimizer's `no_sync`), both are forwarded to the owner.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch


class Readiness:
    """Forwards `ready(i)` (parameter i's gradient is accumulated) and `done()` (the backward
    finished) to the owner, and remembers the order in which parameters first became ready."""

    def __init__(self, params: Sequence[torch.Tensor], ready: Callable[[int], None], done: Callable[[], None]) -> None:
        self._ready, self._done = ready, done
        self.order: list[int] = []
        self._seen: set[int] = set()
        self._queued = False
        self._paused = False
        self._handles = [
            p.register_post_accumulate_grad_hook(self._hook(i)) for i, p in enumerate(params) if p.requires_grad
        ]

    def _hook(self, i: int) -> Callable[[torch.Tensor], None]:
        def hook(_: torch.Tensor) -> None:
            if i not in self._seen:
                self._seen.add(i)
                self.order.append(i)
            if self._paused:
                return
            if not self._queued:
                self._queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            self._ready(i)

        return hook

    def _finish(self) -> None:
        self._queued = False
        self._done()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Gradients accumulate in `.grad` without reports (nesting is allowed)."""
        before, self._paused = self._paused, True
        try:
            yield
        finally:
            self._paused = before

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

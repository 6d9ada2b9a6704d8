"""Asynchronous calls that keep collectives in the same order on every rank.

Each backend gets one worker thread; async calls queue on it and synchronous calls made
while it has work queue behind them, so the order of collectives on the wire is always the
order of the calls. The heavy lifting (C kernels, collectives) releases the GIL, so the
caller computes meanwhile.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

_executors: dict[int, ThreadPoolExecutor] = {}
_pending: dict[int, int] = {}
_lock = threading.Lock()


class Pending:
    """The handle of an async call: `wait()` returns its result or raises its error."""

    def __init__(self, future: Future) -> None:
        self._future = future

    def wait(self) -> Any:
        return self._future.result()

    def is_completed(self) -> bool:
        return self._future.done()

    def get_future(self) -> torch.futures.Future:
        """A torch Future of the result (what a DDP comm hook returns); it holds the error if
        the call fails."""
        out: torch.futures.Future = torch.futures.Future()

        def forward(done: Future) -> None:
            failure = done.exception()
            if failure is None:
                out.set_result(done.result())
            else:
                out.set_exception(failure)

        self._future.add_done_callback(forward)
        return out


def submit(owner: object, fn: Callable, *args) -> Pending:
    """Queue fn(*args) on `owner`'s worker thread."""
    key = id(owner)
    with _lock:
        if key not in _executors:
            _executors[key] = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compcomm")
        _pending[key] = _pending.get(key, 0) + 1
        future = _executors[key].submit(fn, *args)
    future.add_done_callback(lambda _: _done(key))
    return Pending(future)


def _done(key: int) -> None:
    with _lock:
        _pending[key] -= 1


def run_in_order(owner: object, fn: Callable, *args) -> Any:
    """fn(*args) now, or behind `owner`'s queued async calls if it has any."""
    with _lock:
        busy = _pending.get(id(owner), 0) > 0
    return submit(owner, fn, *args).wait() if busy else fn(*args)


def wait_all(handles: list[Pending]) -> None:
    """Wait for every handle, even after one fails, then raise the first failure."""
    failure: BaseException | None = None
    for handle in handles:
        try:
            handle.wait()
        except BaseException as exc:
            failure = failure or exc
    if failure is not None:
        raise failure

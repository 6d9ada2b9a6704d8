"""The order of compcomm's collectives: one ordered lane per process group, on a private transport.

Every collective compcomm issues (a compressed call's phases, the optimizers' uncompressed
all-reduces, barriers) runs on a `Channel`: a private duplicate of the caller's group (made once,
at the first call), so it can never pair with the caller's own collectives on that group, and
a FIFO of tickets, so that compcomm's own calls leave in the order they were submitted, whatever
thread submitted them and however many backend objects share the group. A call takes its tickets
(one per channel it uses, all at once, under one lock, so calls over several channels cannot
deadlock) when it is submitted, and runs when every one of its tickets is being served:
synchronous calls in the caller's thread, async ones on the channel's worker thread. The heavy
work (C kernels, transfers) releases the GIL, so the caller computes meanwhile.

What stays the caller's job, as with any collective: every rank submits the same calls in the same
order per group. Calls submitted from several threads are ordered by submission time on each rank,
which only matches across ranks when the threads are themselves ordered.

A channel lives as long as its group: one whose group was destroyed (torch's default group
made again) is closed, once idle, when a channel is next opened (`retire`), so that its transport
does not keep its sockets and threads for the life of the process.

A broken channel. A backend whose collective timed out (mpi, shm: gloo and nccl time out inside
torch, whose process group is then unusable too) marks its channel broken (`break_channel`): the
transport may still hold the unfinished collective and its peers are out of step, so every call
waiting for its turn on the channel, every later call, and every backend object opened over the
same group later raise RuntimeError at once, naming the first failure (an async call queued on
the channel's worker thread behind a call that is still running is refused as soon as that call
returns). A call queued behind a hung one therefore raises when the hung call's own timeout
expires, not after a timeout of its own on top of it. A call's wait for its turn has no bound of
its own: the call ahead may be healthy and merely long (a large tensor on a slow link, a peer
that arrives late), and only its own waits can tell. A call over several channels refused on one
breaks the others (see `_await_turn`).
"""

from __future__ import annotations

import atexit
import threading
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

_cond = threading.Condition()
_registry: dict[Hashable, Channel] = {}
_opening: dict[Hashable, threading.Lock] = {}
_held = threading.local()
_broken: dict[Hashable, str] = {}


class Channel:
    """One ordered lane of collectives over one private transport (a process group or communicator)."""

    def __init__(self, key: Hashable, transport: Any) -> None:
        self.key = key
        self.transport = transport
        self._issued = 0
        self._serving = 0
        self._running = 0  # calls past their turn and not yet done (a hung one stays counted)
        self.retired: str | None = None  # why it was closed (`retire`): what its late calls raise
        self._worker: ThreadPoolExecutor | None = None

    def worker(self) -> ThreadPoolExecutor:
        """The thread that runs this channel's async calls (made on first use)."""
        with _cond:
            if self._worker is None:
                self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compcomm")
            return self._worker

    def __repr__(self) -> str:
        return f"<Channel {self.key!r}: {self._issued} issued, serving {self._serving}>"


def channel(key: Hashable, open_transport: Callable[[], Any]) -> Channel:
    """The channel of `key`, opening its private transport on first use.

    Opening is a collective over the group's members (a rendezvous), so it happens in the
    caller's thread at the first call, which every member makes; two threads asking at once
    open it once.
    """
    found = _registry.get(key)  # without the lock: a dict read is atomic, and a channel broken or
    if found is not None and key not in _broken:  # retired after it is read refuses in `_await_turn`
        return found
    with _cond:
        refuse_if_broken([key])
        found = _registry.get(key)
        if found is not None:
            return found
        lock = _opening.setdefault(key, threading.Lock())
    with lock:
        with _cond:
            found = _registry.get(key)
        if found is None:
            found = Channel(key, open_transport())
            with _cond:
                _registry[key] = found
        return found


def break_channel(key: Hashable, reason: str) -> None:
    """Mark the channel of `key` unusable (the first reason stays): calls waiting for their turn
    on it raise RuntimeError now, later calls and channels opened under `key` at once."""
    with _cond:
        _broken.setdefault(key, reason)
        _cond.notify_all()


def broken(key: Hashable) -> str | None:
    """Why the channel of `key` is unusable, or None."""
    return _broken.get(key)


def refuse_if_broken(keys: Sequence[Hashable]) -> None:
    """RuntimeError, naming the first failure, if the channel of any of `keys` is broken."""
    reason = next((_broken[k] for k in keys if k in _broken), None)
    if reason is not None:
        raise _unusable(reason)


def _unusable(reason: str) -> RuntimeError:
    return RuntimeError(f"compcomm's collectives over this group are unusable after an earlier failure: {reason}")


def retire(stale: Callable[[Hashable], bool]) -> None:
    """Close the channels whose key `stale` names and on which no call runs (nor waits, unless the
    channel is broken: its waiting calls raise): those of groups that no longer exist (a default
    group destroyed and made again), whose private transports would otherwise keep their sockets,
    threads and buffers for the life of the process. A broken one's reason moves onto the
    channel, for calls that still hold it (kept by key, it would keep the old group alive)."""
    with _cond:
        keys = [
            key
            for key, ch in _registry.items()
            if stale(key) and ch._running == 0 and (ch._serving == ch._issued or key in _broken)
        ]
        channels = [_registry.pop(key) for key in keys]
        for key, ch in zip(keys, channels):
            _opening.pop(key, None)
            ch.retired = _broken.pop(key, None) or "its group was destroyed"
    for ch in channels:
        _close(ch)


@atexit.register
def _close_all() -> None:
    """Let the workers finish and drop the private transports while the interpreter is still
    whole: their destructors join native threads, which must not happen during its teardown."""
    with _cond:
        channels = list(_registry.values())
        _registry.clear()
    for ch in channels:
        _close(ch)


def _close(ch: Channel) -> None:
    """Let the channel's worker finish, then drop its transport (whose destructor closes it)."""
    if ch._worker is not None:
        ch._worker.shutdown(wait=True)
        ch._worker = None
    ch.transport = None


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


def _holding() -> set[int]:
    if not hasattr(_held, "channels"):
        _held.channels = set()
    return _held.channels


def holds(channel_: Channel) -> bool:
    """Whether this thread is running a call that holds `channel_`."""
    return id(channel_) in _holding()


def _take(channels: Sequence[Channel]) -> list[int]:
    with _cond:
        tickets = [ch._issued for ch in channels]
        for ch in channels:
            ch._issued += 1
    return tickets


def _execute(channels: Sequence[Channel], tickets: list[int], fn: Callable, args: tuple) -> Any:
    _await_turn(channels, tickets)
    held = _holding()
    mine = {id(ch) for ch in channels} - held
    held |= mine
    try:
        return fn(*args)
    finally:
        held -= mine
        with _cond:
            for ch in channels:
                ch._serving += 1
                ch._running -= 1
            _cond.notify_all()


def _await_turn(channels: Sequence[Channel], tickets: list[int]) -> None:
    """Until every ticket is being served; RuntimeError once a channel is broken. A call over
    several channels (a hierarchical one) that is refused on one breaks the others too: this
    rank will not make its collectives there, which its peers on those groups may be making,
    so none of its later calls there may run."""
    with _cond:
        while True:
            reasons = (_broken.get(ch.key) or ch.retired for ch in channels)
            reason = next((why for why in reasons if why is not None), None)
            if reason is not None:
                for ch in channels:
                    if ch.retired is None:
                        _broken.setdefault(ch.key, reason)
                _cond.notify_all()
                raise _unusable(reason)
            if all(ch._serving == t for ch, t in zip(channels, tickets)):
                for ch in channels:
                    ch._running += 1
                return
            _cond.wait()


def run(channels: Sequence[Channel], fn: Callable, *args) -> Any:
    """fn(*args) in this thread, in its turn on every channel (at once if this thread already
    holds them all, i.e. fn is part of a call that is running)."""
    if all(holds(ch) for ch in channels):
        return fn(*args)
    return _execute(channels, _take(channels), fn, args)


def submit(channels: Sequence[Channel], fn: Callable, *args) -> Pending:
    """fn(*args) on the first channel's worker thread, in its turn on every channel; inside a call
    that holds them all, at once (a later turn would wait for the very call that waits on it)."""
    if all(holds(ch) for ch in channels):
        done: Future = Future()
        try:
            done.set_result(fn(*args))
        except Exception as exc:
            done.set_exception(exc)
        return Pending(done)
    tickets = _take(channels)
    return Pending(channels[0].worker().submit(_execute, channels, tickets, fn, args))


def sequence_number(channel_: Channel) -> int:
    """The ticket of the call running now on `channel_` (the same on every rank for the same call)."""
    return channel_._serving

"""The ordering core's bounded turn: a call queued behind a call that makes no progress gives up
after its own timeout and breaks the channel (later calls, and channels opened under the same
key, raise at once), while a queue that keeps moving is never cut short. In one process, on
channels whose calls are plain functions: what is tested is the queue, not a transport (the
backends' own timeouts are tested over mpirun in test_mpi.py and on spawned ranks in test_shm.py)."""

from __future__ import annotations

import threading
import time

import pytest

from compcomm.backends import ordering


def fresh_channel(name: str) -> ordering.Channel:
    return ordering.channel(("test_ordering", name, time.monotonic_ns()), lambda: None)


def test_a_call_behind_a_stuck_call_raises_after_its_own_timeout_and_breaks_the_channel():
    ch = fresh_channel("stuck")
    release = threading.Event()
    stuck = ordering.submit([ch], release.wait, 30.0)  # the call ahead, with a long bound of its own
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"waited 0.5s for its turn"):
        ordering.run([ch], lambda: "ran", timeout=0.5)
    assert 0.5 <= time.monotonic() - start < 2.0
    release.set()
    assert stuck.wait() is True  # the call ahead still ends as it would
    assert ch.broken is not None and "out of step" in ch.broken
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="unusable after an earlier failure"):
        ordering.run([ch], lambda: "ran", timeout=30.0)
    with pytest.raises(RuntimeError, match="unusable after an earlier failure"):
        ordering.submit([ch], lambda: "ran").wait()
    with pytest.raises(RuntimeError, match="unusable after an earlier failure"):
        ordering.channel(ch.key, lambda: None)
    assert time.monotonic() - start < 0.5


def test_a_queue_that_keeps_moving_is_not_cut_short():
    ch = fresh_channel("moving")
    queued = [ordering.submit([ch], time.sleep, 0.3) for _ in range(4)]
    start = time.monotonic()
    assert ordering.run([ch], lambda: "ran", timeout=0.5) == "ran"  # 1.2 s of turns, each under 0.5 s
    assert time.monotonic() - start >= 1.1
    for handle in queued:
        handle.wait()
    assert ch.broken is None


def test_a_broken_channel_releases_calls_already_waiting_on_it():
    """A synchronous call waiting (unbounded) behind a stuck async call is released at once; an
    async call queued behind it shares the channel's one worker thread, so it is refused when the
    stuck call returns, before it runs."""
    ch = fresh_channel("released")
    release = threading.Event()
    ordering.submit([ch], release.wait, 30.0)
    queued_async = ordering.submit([ch], lambda: "ran")
    outcome: list[BaseException | str] = []

    def wait_unbounded() -> None:
        try:
            outcome.append(ordering.run([ch], lambda: "ran", timeout=None))
        except RuntimeError as exc:
            outcome.append(exc)

    waiting = threading.Thread(target=wait_unbounded)
    waiting.start()
    time.sleep(0.1)
    start = time.monotonic()
    ordering.break_channel(ch.key, "a peer stopped answering")
    waiting.join(5.0)
    assert time.monotonic() - start < 0.5
    assert isinstance(outcome[0], RuntimeError) and "a peer stopped answering" in str(outcome[0])
    release.set()
    with pytest.raises(RuntimeError, match="a peer stopped answering"):
        queued_async.wait()

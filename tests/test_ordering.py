"""The ordering core's broken channel: once a call over a group times out and breaks its channel,
calls already waiting for their turn, later calls, and channels opened under the same key raise
at once; while nothing is broken, a long queue is never cut short. In one process, on channels
whose calls are plain functions: what is tested is the queue, not a transport (the backends'
own timeouts are tested over mpirun in test_mpi.py and on spawned ranks in test_shm.py)."""

from __future__ import annotations

import threading
import time

import pytest

from compcomm.backends import ordering


def fresh_channel(name: str) -> ordering.Channel:
    return ordering.channel(("test_ordering", name, time.monotonic_ns()), lambda: None)


def test_a_long_queue_is_never_cut_short():
    """A call behind calls that take long (a large tensor, a late peer) waits for its turn,
    however long: only the calls' own waits have bounds."""
    ch = fresh_channel("long")
    queued = [ordering.submit([ch], time.sleep, 0.4) for _ in range(3)]
    start = time.monotonic()
    assert ordering.run([ch], lambda: "ran") == "ran"
    assert time.monotonic() - start >= 1.1
    for handle in queued:
        handle.wait()
    assert ordering.broken(ch.key) is None


def test_a_broken_channel_releases_calls_already_waiting_on_it():
    """A synchronous call waiting behind a hung async call is released as soon as the channel
    breaks (the hung call's own timeout, in a backend); an async call queued behind it shares
    the channel's one worker thread, so it is refused when the hung call returns, before it
    runs. Later calls and channels opened under the same key are refused at once."""
    ch = fresh_channel("released")
    release = threading.Event()
    hung = ordering.submit([ch], release.wait, 30.0)
    queued_async = ordering.submit([ch], lambda: "ran")
    outcome: list[BaseException | str] = []

    def wait_for_turn() -> None:
        try:
            outcome.append(ordering.run([ch], lambda: "ran"))
        except RuntimeError as exc:
            outcome.append(exc)

    waiting = threading.Thread(target=wait_for_turn)
    waiting.start()
    time.sleep(0.1)
    start = time.monotonic()
    ordering.break_channel(ch.key, "a peer stopped answering")
    waiting.join(5.0)
    assert time.monotonic() - start < 0.5
    assert isinstance(outcome[0], RuntimeError) and "a peer stopped answering" in str(outcome[0])
    release.set()
    assert hung.wait() is True  # the call that was running ends as it would
    with pytest.raises(RuntimeError, match="a peer stopped answering"):
        queued_async.wait()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="unusable after an earlier failure"):
        ordering.run([ch], lambda: "ran")
    with pytest.raises(RuntimeError, match="unusable after an earlier failure"):
        ordering.submit([ch], lambda: "ran").wait()
    with pytest.raises(RuntimeError, match="unusable after an earlier failure"):
        ordering.channel(ch.key, lambda: None)
    assert time.monotonic() - start < 0.5


def test_a_broken_channel_leaves_other_groups_alone():
    broken, other = fresh_channel("broken"), fresh_channel("other")
    ordering.break_channel(broken.key, "a peer stopped answering")
    assert ordering.run([other], lambda: "ran") == "ran" and ordering.broken(other.key) is None


def test_a_call_refused_on_one_of_its_channels_breaks_the_others():
    """A call over two groups (a hierarchical one) refused because one is broken will not make
    its collectives on the other, where its peers may be making them: later calls there must
    not run out of step, so that channel is broken too."""
    node, across = fresh_channel("node"), fresh_channel("across")
    ordering.break_channel(across.key, "a peer across nodes stopped answering")
    with pytest.raises(RuntimeError, match="across nodes stopped answering"):
        ordering.run([node, across], lambda: "ran")
    with pytest.raises(RuntimeError, match="across nodes stopped answering"):
        ordering.run([node], lambda: "ran")

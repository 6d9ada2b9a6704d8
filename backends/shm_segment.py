"""The shared-memory segment of one group of ranks on one host: its layout, creation and cleanup.

Layout (offsets in bytes; n ranks, slot size S, both fixed for the segment's life):

    [0, 64)                   header: magic, n, S (int64)
    [64 (1 + r), 64 (2 + r))  rank r's control line (one cache line): phase counter, pid, and the
                              descriptor of its current call (kind, bytes)
    [D + r S, D + (r + 1) S)  rank r's slot, D = the control lines rounded up to a page

Each rank writes only its own control line and its own slot; peers only read them. So no two
processes ever write the same cache line, and the only cross-process signal is a counter that
one rank stores and the others load (see `backends/shm.py` for the protocol and why it is
ordered correctly).

Creation is a rendezvous over the group's key-value store (the torch.distributed store): rank 0
creates the file under `directory` (/dev/shm: POSIX shared memory) with a unique name, sizes it and
writes the header, then publishes the name; every other rank opens and maps it and reports back;
once all have reported, rank 0 unlinks the name. From then on the memory has no name: it lives
exactly as long as some rank still maps it, so nothing is left in /dev/shm when a rank crashes,
exits or drops the segment. Only a rank 0 killed outright (SIGKILL) inside the rendezvous, a few
milliseconds, can leave a name behind; the next segment's creator removes such names once their
creator's process is gone (`sweep_stale`).
"""

from __future__ import annotations

import datetime
import mmap
import os
import secrets
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

SHM_DIRECTORY = "/dev/shm"
PREFIX = "compcomm-shm-"
_MAGIC = 0x636F6D70636F6D6D  # "compcomm"
_LINE = 64  # bytes: a cache line
_PAGE = 4096
COUNTER, PID, KIND, NBYTES, LEFT = range(5)  # words of a control line (LEFT: 1 once it left, `Segment.leave`)
_LINE_WORDS = _LINE // 8
_STALE_AFTER_S = 60.0


class Segment:
    """One mapped segment: this rank's view of every slot and control line."""

    def __init__(self, memory: mmap.mmap, world: int, rank: int, slot_bytes: int) -> None:
        self.world, self.rank, self.slot_bytes = world, rank, slot_bytes
        self._memory: mmap.mmap | None = memory
        self.control = np.ndarray((world, _LINE_WORDS), dtype=np.int64, buffer=memory, offset=_LINE)
        if slot_bytes:
            data = torch.frombuffer(memory, dtype=torch.uint8, count=world * slot_bytes, offset=data_offset(world))
            self.slots = data.view(world, slot_bytes)
        else:
            self.slots = torch.empty(world, 0, dtype=torch.uint8)

    def post(self, value: int) -> None:
        """Store this rank's phase counter (one aligned 8-byte store)."""
        self.control[self.rank, COUNTER] = value

    def reached(self, value: int) -> bool:
        """Whether every rank's counter is at least `value`."""
        return bool((self.control[:, COUNTER] >= value).all())

    def behind(self, value: int) -> list[int]:
        """The ranks whose counter is still below `value`."""
        return [int(r) for r in np.flatnonzero(self.control[:, COUNTER] < value)]

    def describe(self, kind: int, nbytes: int) -> None:
        """Publish what this rank's current call is (read by peers after the next counter)."""
        self.control[self.rank, KIND] = kind
        self.control[self.rank, NBYTES] = nbytes

    def leave(self) -> None:
        """Mark this rank as gone from the segment's calls (it will post no more), for the peers
        waiting on its counter; its descriptor stays, for peers still checking the last call."""
        self.control[self.rank, LEFT] = 1

    def left(self, ranks: list[int]) -> list[int]:
        """Those of `ranks` that left (`leave`)."""
        return [r for r in ranks if self.control[r, LEFT]]

    def descriptors(self) -> list[tuple[int, int]]:
        return [(int(k), int(b)) for k, b in self.control[:, KIND : NBYTES + 1]]

    def pids(self) -> list[int]:
        return [int(p) for p in self.control[:, PID]]

    def close(self) -> None:
        """Unmap (the memory goes once every rank has): drop the views first, which pin the map."""
        memory, self._memory = self._memory, None
        self.slots = torch.empty(self.world, 0, dtype=torch.uint8)
        self.control = np.zeros((self.world, _LINE_WORDS), dtype=np.int64)
        if memory is not None:
            try:
                memory.close()
            except BufferError:  # a view still held somewhere (a traceback): freed with it
                pass


def data_offset(world: int) -> int:
    return -(-_LINE * (1 + world) // _PAGE) * _PAGE


_FIRST_POLL_S, _LAST_POLL_S = 1e-4, 1e-2
"""The rendezvous polls the store, from every 0.1 ms to every 10 ms as the wait grows."""


def open_segment(
    store: Any, key: str, rank: int, world: int, slot_bytes: int, timeout: float, directory: str = SHM_DIRECTORY
) -> Segment:
    """Create (rank 0) or attach (the others) the segment of rendezvous `key`, with slots of the
    largest `slot_bytes` any rank asks for (ranks passing different sizes to a call then meet
    in one segment, where the call's check tells them so): a collective over the group, bounded
    by `timeout` seconds. RuntimeError on every rank when any rank fails (e.g. ranks that do not
    share `directory`, i.e. are not on one host)."""
    wait = datetime.timedelta(seconds=timeout)
    name_key, reports = f"{key}/name", [f"{key}/attached/{r}" for r in range(world)]
    wanted = [f"{key}/slot_bytes/{r}" for r in range(world)]
    store.set(wanted[rank], str(slot_bytes))
    _store_wait(store, wanted, wait, "every rank's segment size")
    slot_bytes = max(int(store.get(k)) for k in wanted)
    size = data_offset(world) + world * slot_bytes
    path: Path | None = None
    memory: mmap.mmap | None = None
    problem = ""
    try:
        if rank == 0:
            try:
                sweep_stale(directory)
                path, memory = _create(directory, size, world, slot_bytes)
                store.set(name_key, path.name)
            except OSError as exc:
                store.set(name_key, "")
                raise RuntimeError(
                    f"rank 0 could not create a shared-memory segment of {size} bytes in {directory} ({exc}); "
                    "a container's /dev/shm may be small (docker run --shm-size), or use gloo inside the node"
                ) from exc
        else:
            name = _store_wait(store, [name_key], wait, "the segment's name from rank 0").get(name_key).decode()
            if not name:
                raise RuntimeError(f"rank 0 could not create a shared-memory segment in {directory}")
            try:
                memory = _attach(Path(directory, name), size, world, slot_bytes)
            except (OSError, ValueError) as exc:
                problem = f"rank {rank} cannot map {name} in {directory} ({exc})"
        segment = None
        if memory is not None:
            segment = Segment(memory, world, rank, slot_bytes)
            segment.control[rank, PID] = os.getpid()
        store.set(reports[rank], problem or "ok")
        _store_wait(store, reports, wait, "every rank's attachment")
        if rank == 0 and path is not None:
            path.unlink(missing_ok=True)
            path = None
        failures = [msg.decode() for r in range(world) if (msg := store.get(reports[r])) != b"ok"]
        if failures:
            if segment is not None:
                segment.close()
            raise RuntimeError(
                "the shm backend's ranks do not share memory: "
                + "; ".join(failures)
                + ". Its group must hold ranks of one host only (use gloo between hosts)"
            )
        assert segment is not None
        return segment
    finally:
        if path is not None:  # rank 0 failed inside the rendezvous: leave no name behind
            path.unlink(missing_ok=True)


class RendezvousTimeout(RuntimeError):
    """A rank of the group never reached the rendezvous: the group's segment numbering is out of step."""


def _store_wait(store: Any, keys: list[str], wait: datetime.timedelta, what: str) -> Any:
    """`store` once every one of `keys` is in it, polled (`check`) rather than waited for: the
    threads of a process share the default store's client, on which a blocking wait holds up
    their other requests, so that a segment made on a channel's worker thread while another
    channel opens its transport in the caller's thread (or makes its own segment) could wait
    for each other across ranks until the timeout. RendezvousTimeout after `wait`."""
    deadline, pause = time.monotonic() + wait.total_seconds(), _FIRST_POLL_S
    while not store.check(keys):
        if time.monotonic() >= deadline:
            raise RendezvousTimeout(
                f"the shm backend timed out after {wait.total_seconds():g}s waiting for {what}: a rank of "
                "its group did not reach the same call (crashed, hung, or out of step)"
            )
        time.sleep(pause)
        pause = min(2 * pause, _LAST_POLL_S)
    return store


def _create(directory: str, size: int, world: int, slot_bytes: int) -> tuple[Path, mmap.mmap]:
    path = Path(directory, f"{PREFIX}{os.getpid()}-{secrets.token_hex(8)}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)  # ENOSPC now, not SIGBUS at the first touch of a page
        memory = mmap.mmap(fd, size)
    except OSError:
        path.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)
    header = np.ndarray(3, dtype=np.int64, buffer=memory)
    header[:] = (_MAGIC, world, slot_bytes)
    del header
    return path, memory


def _attach(path: Path, size: int, world: int, slot_bytes: int) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR)
    try:
        if os.fstat(fd).st_size != size:
            raise ValueError(f"size {os.fstat(fd).st_size} != {size}")
        memory = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    header = np.ndarray(3, dtype=np.int64, buffer=memory)
    ok = tuple(int(v) for v in header) == (_MAGIC, world, slot_bytes)
    del header
    if not ok:
        memory.close()
        raise ValueError("not a segment of this group")
    return memory


def alive(pid: int) -> bool:
    """Whether process `pid` exists and has not exited (as this pid namespace sees it): a rank
    that died but was not yet reaped by its parent (a zombie) counts as gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rpartition(")")[2].split()[:1] not in (["Z"], ["X"])


def sweep_stale(directory: str = SHM_DIRECTORY) -> None:
    """Remove segment names whose creator is gone and that are older than a minute: what a rank
    0 killed inside a rendezvous left. (The age guards a creator in another pid namespace.)"""
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return
    now = time.time()
    for entry in entries:
        if not entry.name.startswith(PREFIX):
            continue
        try:
            pid = int(entry.name[len(PREFIX) :].split("-")[0])
            if not alive(pid) and now - entry.stat().st_mtime > _STALE_AFTER_S:
                os.unlink(entry.path)
        except (ValueError, OSError):
            continue

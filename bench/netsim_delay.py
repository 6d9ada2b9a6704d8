#!/usr/bin/env python3
"""The delay line of bench/netsim.py: a constant one-way delay on every packet between hosts.

    python bench/netsim_delay.py --src dl-in --dst dl-out --delay 0.02

Where the kernel has netem, a qdisc delays packets; where it has not, this process does. It runs
in the cluster's router namespace, where policy routing sends every packet that a host sends to
another host into the TUN device `--src`. Each packet read there is held for `--delay` seconds
and then written, in arrival order (a FIFO: every packet waits the same time, so nothing is
reordered), to the TUN device `--dst`, whose packets the router forwards to their destination.

It is cheap because packets are few: netsim gives the links and the TUN devices an MTU of 64000,
so 100 Mbit/s is about 200 packets a second; each costs one read, one write and a deque entry.
It is "the network": it runs outside every host's CPU quota.

It prints "ready" once both devices are open (a TUN device without a reader drops what is
routed to it), runs until its standard input closes (netsim closes it, or netsim died), then
prints one line of totals: packets, bytes, and the CPU seconds it used.
"""

from __future__ import annotations

import argparse
import collections
import fcntl
import os
import resource
import select
import struct
import sys
import time
from collections.abc import Callable

TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000  # raw IP packets, no 4-byte packet-information header
MAX_PACKET = 65536
LATENESS_WEIGHT = 0.1  # of each new sample in the running estimate of the timer's lateness


def open_tun(name: str) -> int:
    """A non-blocking fd on the existing TUN device `name` (made with `ip tuntap add ... mode tun`)."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    try:
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    except OSError:
        os.close(fd)
        raise
    return fd


class DelayLine:
    """Packets read from `src` come out of `dst` `delay` seconds later, in order."""

    def __init__(self, src: int, dst: int, delay: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.src, self.dst, self.delay, self.clock = src, dst, delay, clock
        self.queue: collections.deque[tuple[float, bytes]] = collections.deque()
        self.packets = 0
        self.bytes = 0
        self.lateness = 0.0  # seconds a timed wait is expected to oversleep

    def run(self, stop: int) -> None:
        """Forward until `stop` (a pipe's read end) is readable: closed, or written to."""
        while True:
            wait = self.timeout()
            target = None if not wait else self.clock() + wait
            readable, _, _ = select.select([self.src, stop], [], [], wait)
            if stop in readable:
                return
            if self.src in readable:
                self.take()
            elif target is not None:  # the wait ran out: how late did it return?
                self.observe_lateness(self.clock() - target)
            self.release()

    def timeout(self) -> float | None:
        """Seconds to wait for the oldest held packet (None: nothing held, wait for input)."""
        if not self.queue:
            return None
        return max(0.0, self.queue[0][0] - self.lateness - self.clock())

    def observe_lateness(self, sample: float) -> None:
        """Learn how late a timed wait returns (a timer's wake-up latency, 0.1-0.3 ms here): packets
        are released that much early, so that on average they leave when due."""
        sample = min(max(sample, 0.0), self.delay)
        self.lateness += LATENESS_WEIGHT * (sample - self.lateness)

    def take(self) -> None:
        """Read every packet waiting on `src`, each due `delay` from now."""
        while True:
            try:
                packet = os.read(self.src, MAX_PACKET)
            except BlockingIOError:
                return
            if not packet:
                return
            self.queue.append((self.clock() + self.delay, packet))

    def release(self) -> None:
        """Write every packet whose time has come (less the expected lateness) to `dst`."""
        now = self.clock() + self.lateness
        while self.queue and self.queue[0][0] <= now:
            _, packet = self.queue.popleft()
            try:
                os.write(self.dst, packet)
            except OSError as exc:  # a packet the stack refuses is lost, like on a real link
                print(f"[delayline] dropped a packet of {len(packet)} B: {exc}", file=sys.stderr)
                continue
            self.packets += 1
            self.bytes += len(packet)

    def totals(self) -> str:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        cpu = usage.ru_utime + usage.ru_stime
        return (
            f"{self.packets} packets, {self.bytes} bytes, {cpu:.3f} s CPU, timer lateness {self.lateness * 1e6:.0f} us"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--src", required=True, help="TUN device the packets come from")
    p.add_argument("--dst", required=True, help="TUN device the packets go to")
    p.add_argument("--delay", type=float, required=True, help="seconds each packet is held")
    args = p.parse_args(argv)
    line = DelayLine(open_tun(args.src), open_tun(args.dst), args.delay)
    print("ready", flush=True)
    try:
        line.run(sys.stdin.fileno())
    except KeyboardInterrupt:
        pass
    print(line.totals(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

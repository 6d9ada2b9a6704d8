#!/usr/bin/env python3
"""What a simulated link delivers between two hosts: TCP round trip and bulk throughput.

    python bench/netsim.py --hosts 2 --rate 100mbit --delay 20ms -- python bench/link_probe.py

The first rank of host 1 (rank LOCAL_WORLD_SIZE) connects to rank 0 on host 0 (MASTER_ADDR,
MASTER_PORT + 1) over one TCP connection with the system's default buffers, then measures
  - the round trip: one byte there and back, `--pings` times (TCP_NODELAY); median, min, max;
  - the throughput: `--bulk-mib` MiB sent to rank 0, timed until rank 0 acknowledges the last
    byte (slow start included, as a collective's first call would see it).
Under time dilation (bench/netsim.py --cpus-per-host) the times are reported divided by d,
i.e. as the emulated cluster's (bench/emulation.py); the measured ones are printed beside them.
The other ranks do nothing.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time

import emulation

CHUNK = 1 << 20
HEADER = 64  # bytes: the pings and bulk bytes to expect, as text


def serve(addr: tuple[str, int]) -> None:
    """Rank 0: echo each ping byte, swallow the bulk transfer, acknowledge its end."""
    with socket.create_server(addr) as server:
        conn, _ = server.accept()
    with conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        header = b""
        while len(header) < HEADER:
            header += conn.recv(HEADER - len(header))
        pings, bulk = (int(x) for x in header.decode().split())
        for _ in range(pings):
            conn.sendall(conn.recv(1))
        received = 0
        while received < bulk:
            received += len(conn.recv(CHUNK))
        conn.sendall(b"k")


def connect(addr: tuple[str, int], wait: float = 30.0) -> socket.socket:
    """Rank 1: connect once rank 0 listens."""
    deadline = time.monotonic() + wait
    while True:
        try:
            return socket.create_connection(addr)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def probe(addr: tuple[str, int], pings: int, bulk: int) -> tuple[list[float], float]:
    """(round-trip seconds of each ping, seconds for the bulk transfer)."""
    with connect(addr) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.sendall(f"{pings} {bulk}".ljust(HEADER).encode())
        rtts = []
        for _ in range(pings):
            start = time.perf_counter()
            conn.sendall(b"x")
            conn.recv(1)
            rtts.append(time.perf_counter() - start)
        chunk = bytes(CHUNK)
        start = time.perf_counter()
        for offset in range(0, bulk, CHUNK):
            conn.sendall(chunk[: min(CHUNK, bulk - offset)])
        conn.recv(1)
        return rtts, time.perf_counter() - start


def report(rtts: list[float], seconds: float, bulk: int) -> str:
    """The measured figures and, where dilated, the emulated ones."""
    d = emulation.dilation()
    lines = [
        f"# link_probe: rate {os.environ.get('NETSIM_RATE') or '?'}, delay {os.environ.get('NETSIM_DELAY') or '-'}"
    ]
    for name, scale in (("measured", 1.0), ("emulated (time / d)", d)) if d != 1 else (("measured", 1.0),):
        lines.append(
            f"{name}: round trip median {statistics.median(rtts) / scale * 1e3:.2f} ms "
            f"(min {min(rtts) / scale * 1e3:.2f}, max {max(rtts) / scale * 1e3:.2f}, {len(rtts)} pings); "
            f"{bulk / 2**20:g} MiB in {seconds / scale:.3f} s = {bulk * 8 / (seconds / scale) / 1e6:.1f} Mbit/s"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pings", type=int, default=20, help="round trips to time (default 20)")
    p.add_argument("--bulk-mib", type=float, default=64, help="MiB to send for the throughput (default 64)")
    args = p.parse_args(argv)
    rank, peer = int(os.environ.get("RANK", "-1")), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if rank < 0 or int(os.environ.get("WORLD_SIZE", "1")) <= peer:
        p.error("run under bench/netsim.py with at least 2 hosts")
    addr = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]) + 1)
    bulk = int(args.bulk_mib * 2**20)
    if rank == 0:
        serve(addr)
    elif rank == peer:
        rtts, seconds = probe(addr, args.pings, bulk)
        print(report(rtts, seconds, bulk), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

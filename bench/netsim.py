#!/usr/bin/env python3
"""A simulated Ethernet cluster on one machine, for benchmarking collectives over a slow link.

    python bench/netsim.py --hosts 4 --rate 1gbit [--delay 0.1ms] -- python bench/allreduce_bw.py
    python bench/netsim.py --hosts 2 --ranks-per-host 2 -- python bench/allreduce_bw.py

creates `--hosts` network namespaces joined by one Linux bridge through veth pairs, shapes every
link with tc (a tbf at `--rate`, plus a netem delay when `--delay` is given) on *both* ends of
each veth, so that each host's link is limited in both directions, like a host on a switch port.
It then starts the command `--ranks-per-host` times (K, default 1) per host inside its namespace
with the torchrun environment (RANK = host * K + LOCAL_RANK, WORLD_SIZE = hosts * K, LOCAL_RANK,
LOCAL_WORLD_SIZE = K, GROUP_RANK = host, MASTER_ADDR = host 0, MASTER_PORT, GLOO_SOCKET_IFNAME =
the namespace's interface), waits for all of them and exits with the worst exit code.
Namespaces, veths and the bridge are always removed: on success, failure, Ctrl-C or SIGTERM.

Ranks of one host reach each other at the host's own address, which the kernel routes through
the namespace's loopback: traffic inside a host is unshaped (the fast intra-node link), traffic
between hosts crosses the shaped veths.

Needs root and iproute2 (`ip`, `tc`). Traffic stays inside the namespaces this program creates,
on a private /24 of its own (`--subnet`, default 10.77.0.0/24; the bridge has no address, so the
host's own network is never involved).
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import re
import shutil
import signal
import subprocess
import sys
import time

from units import parse_rate

DEFAULT_SUBNET = "10.77.0.0/24"
NS_IFNAME = "eth0"  # the interface's name inside every namespace


class NetsimError(RuntimeError):
    """A clear, user-facing reason why the simulated cluster cannot be built."""


class _Terminated(BaseException):
    """Raised from the SIGTERM/SIGHUP handler so that `finally` blocks clean up."""


def tbf_burst_bytes(rate_bps: float) -> int:
    """Bucket size: 1 ms worth of traffic, and never below 256 KiB, so that one segmentation-
    offloaded super-packet (up to 64 KiB) always fits (tbf drops packets larger than its bucket)."""
    return max(256 * 1024, int(rate_bps / 8 * 1e-3))


class Cluster:
    """N namespaces on a bridge. Use as a context manager: exiting always tears it all down."""

    def __init__(
        self,
        hosts: int,
        rate: str | None,
        delay: str | None = None,
        subnet: str = DEFAULT_SUBNET,
        tag: str | None = None,
        verbose: bool = False,
        ranks_per_host: int = 1,
    ) -> None:
        if hosts < 1:
            raise NetsimError(f"--hosts must be at least 1, got {hosts}")
        if ranks_per_host < 1:
            raise NetsimError(f"--ranks-per-host must be at least 1, got {ranks_per_host}")
        net = ipaddress.ip_network(subnet, strict=False)
        if net.version != 4 or not net.is_private:
            raise NetsimError(f"--subnet must be a private IPv4 network, got {subnet}")
        usable = list(net.hosts())
        if hosts > len(usable):
            raise NetsimError(f"{subnet} has room for {len(usable)} hosts, not {hosts}")
        self.hosts, self.rate, self.delay, self.verbose = hosts, rate, delay, verbose
        self.ranks_per_host = ranks_per_host
        self.prefixlen = net.prefixlen
        self.addresses = [str(a) for a in usable[:hosts]]
        # Short, unique names: interface names are limited to 15 characters.
        self.tag = tag or f"cs{os.getpid() % 1000000}"
        self.bridge = f"{self.tag}br"
        self.namespaces = [f"{self.tag}-h{i}" for i in range(hosts)]
        self.host_veths = [f"{self.tag}v{i}" for i in range(hosts)]
        self._made_ns: list[str] = []
        self._made_links: list[str] = []

    # -- plumbing -------------------------------------------------------------------------------
    def _ip(self, *args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
        cmd = ["ip"] + (["-n", ns] if ns else []) + list(args)
        return self._run(cmd, check)

    def _tc(self, *args: str, ns: str | None = None) -> subprocess.CompletedProcess:
        cmd = (["ip", "netns", "exec", ns] if ns else []) + ["tc"] + list(args)
        return self._run(cmd, True)

    def _run(self, cmd: list[str], check: bool) -> subprocess.CompletedProcess:
        if self.verbose:
            print("[netsim] " + " ".join(cmd), file=sys.stderr)
        res = subprocess.run(cmd, capture_output=True, text=True)
        if check and res.returncode != 0:
            why = res.stderr.strip() or res.stdout.strip()
            if "qdisc kind is unknown" in why:
                why += " (this kernel lacks the qdisc module: sch_tbf for --rate, sch_netem for --delay)"
            raise NetsimError(f"`{' '.join(cmd)}` failed: {why}")
        return res

    def __enter__(self) -> Cluster:
        try:
            self.build()
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.teardown()

    def build(self) -> None:
        self._ip("link", "add", self.bridge, "type", "bridge")
        self._made_links.append(self.bridge)
        self._ip("link", "set", self.bridge, "up")
        for i, (ns, veth, addr) in enumerate(zip(self.namespaces, self.host_veths, self.addresses)):
            peer = f"{self.tag}p{i}"
            self._ip("netns", "add", ns)
            self._made_ns.append(ns)
            self._ip("link", "add", veth, "type", "veth", "peer", "name", peer)
            self._made_links.append(veth)
            self._ip("link", "set", peer, "netns", ns)
            self._ip("link", "set", peer, "name", NS_IFNAME, ns=ns)
            self._ip("addr", "add", f"{addr}/{self.prefixlen}", "dev", NS_IFNAME, ns=ns)
            self._ip("link", "set", NS_IFNAME, "up", ns=ns)
            self._ip("link", "set", "lo", "up", ns=ns)
            self._ip("link", "set", veth, "master", self.bridge)
            self._ip("link", "set", veth, "up")
            self._shape(veth, None)  # bridge -> host (the host's download)
            self._shape(NS_IFNAME, ns)  # host -> bridge (the host's upload)
            self._check_loopback(ns)

    def _shape(self, dev: str, ns: str | None) -> None:
        if self.rate is None and self.delay is None:
            return
        parent = ["root"]
        if self.rate is not None:
            burst = tbf_burst_bytes(parse_rate(self.rate))
            self._tc(
                "qdisc",
                "add",
                "dev",
                dev,
                "root",
                "handle",
                "1:",
                "tbf",
                "rate",
                self.rate,
                "burst",
                str(burst),
                "latency",
                "100ms",
                ns=ns,
            )
            parent = ["parent", "1:1"]
        if self.delay is not None:
            self._tc(
                "qdisc",
                "add",
                "dev",
                dev,
                *parent,
                "handle",
                "10:",
                "netem",
                "delay",
                self.delay,
                "limit",
                "100000",
                ns=ns,
            )

    def _check_loopback(self, ns: str) -> None:
        out = self._ip("-o", "link", "show", "lo", ns=ns).stdout
        flags = re.search(r"<([^>]*)>", out)
        if not flags or "UP" not in flags.group(1).split(","):
            raise NetsimError(f"loopback in namespace {ns} is not up: {out.strip()}")

    def teardown(self) -> None:
        """Remove everything this cluster made (idempotent; a second Ctrl-C cannot interrupt it)."""
        blocked = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
        try:
            self._teardown()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)

    def _teardown(self) -> None:
        for ns in reversed(self._made_ns):
            self._ip("netns", "del", ns, check=False)  # also destroys the veth pair inside
        for link in reversed(self._made_links):
            if subprocess.run(["ip", "link", "show", link], capture_output=True).returncode == 0:
                self._ip("link", "del", link, check=False)
        self._made_ns.clear()
        self._made_links.clear()

    def leftovers(self) -> list[str]:
        """Names of this cluster's namespaces/links that still exist (empty after teardown)."""
        ns_list = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        present = {line.split()[0] for line in ns_list.splitlines() if line.strip()}
        left = [ns for ns in self.namespaces if ns in present]
        links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
        left += [name for name in [self.bridge, *self.host_veths] if re.search(rf":\s{re.escape(name)}[@:]", links)]
        return left

    # -- running --------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.hosts * self.ranks_per_host

    def environment(self, rank: int, port: int, threads: int) -> dict[str, str]:
        """torchrun's variables for global `rank` (host rank // K, local index rank % K)."""
        k, world = self.ranks_per_host, self.world_size
        env = dict(os.environ)
        env.update(
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK=str(rank % k),
            LOCAL_WORLD_SIZE=str(k),
            GROUP_RANK=str(rank // k),
            GROUP_WORLD_SIZE=str(self.hosts),
            ROLE_RANK=str(rank),
            ROLE_WORLD_SIZE=str(world),
            MASTER_ADDR=self.addresses[0],
            MASTER_PORT=str(port),
            GLOO_SOCKET_IFNAME=NS_IFNAME,
            NCCL_SOCKET_IFNAME=NS_IFNAME,
            OMP_NUM_THREADS=str(threads),
            MKL_NUM_THREADS=str(threads),
            NETSIM_RATE=self.rate or "",
            NETSIM_DELAY=self.delay or "",
            PYTHONUNBUFFERED="1",
        )
        return env

    def run(
        self, command: list[str], port: int, threads: int, timeout: float | None = None, grace: float = 30.0
    ) -> int:
        """Start `command` K times on every host, wait for all; the worst exit code (0 if all succeeded).

        When one rank fails the others get `grace` seconds to finish before they are killed,
        so that a crashed rank never leaves its peers hanging in a collective.
        """
        procs: list[subprocess.Popen] = []
        try:
            for rank in range(self.world_size):
                ns = self.namespaces[rank // self.ranks_per_host]
                procs.append(
                    subprocess.Popen(
                        ["ip", "netns", "exec", ns, *command],
                        env=self.environment(rank, port, threads),
                        start_new_session=True,
                    )
                )
            start, failed_at = time.monotonic(), None
            while any(p.poll() is None for p in procs):
                now = time.monotonic()
                if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
                    failed_at = now
                if failed_at is not None and now - failed_at > grace:
                    print(f"[netsim] a rank failed; stopping the others after {grace:.0f}s", file=sys.stderr)
                    break
                if timeout is not None and now - start > timeout:
                    print(f"[netsim] timed out after {timeout:.0f}s; stopping all ranks", file=sys.stderr)
                    break
                time.sleep(0.05)
        finally:
            _stop(procs)
        return worst_exit_code([p.returncode for p in procs])


def _stop(procs: list[subprocess.Popen]) -> None:
    """Terminate (then kill) the process groups of ranks still running."""
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        alive = [p for p in procs if p.poll() is None]
        if not alive:
            return
        for p in alive:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        for p in alive:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass


def worst_exit_code(codes: list[int | None]) -> int:
    """Shell-style worst code: a signal death (-s) counts as 128+s; a rank never reaped as 1."""
    worst = 0
    for code in codes:
        code = 1 if code is None else (128 - code if code < 0 else code)
        worst = max(worst, code)
    return worst


def preflight() -> None:
    """Refuse clearly when this cannot work."""
    if sys.platform != "linux":
        raise NetsimError("netsim needs Linux network namespaces")
    if os.geteuid() != 0:
        raise NetsimError(
            "netsim must run as root (it creates network namespaces, veths and a bridge); "
            "try: sudo -E python bench/netsim.py ..."
        )
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise NetsimError(f"netsim needs iproute2; missing: {', '.join(missing)} (e.g. apt-get install iproute2)")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" in argv:
        split = argv.index("--")
        argv, command = argv[:split], argv[split + 1 :]
    else:
        command = []
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], usage="%(prog)s [options] -- command [args...]")
    p.add_argument("--hosts", type=int, default=4, help="simulated hosts (default 4)")
    p.add_argument(
        "--ranks-per-host",
        type=int,
        default=1,
        metavar="K",
        help="ranks per host, joined by the host's unshaped loopback (default 1)",
    )
    p.add_argument(
        "--rate",
        default="1gbit",
        help="link rate in tc syntax, e.g. 1gbit, 10gbit, 100mbit; 'none' for unshaped (default 1gbit)",
    )
    p.add_argument("--delay", default=None, help="one-way netem delay per link end, e.g. 0.1ms (default none)")
    p.add_argument("--subnet", default=DEFAULT_SUBNET, help=f"private /24 for the hosts (default {DEFAULT_SUBNET})")
    p.add_argument("--port", type=int, default=29500, help="MASTER_PORT (default 29500)")
    p.add_argument(
        "--threads", type=int, default=None, help="OMP_NUM_THREADS per rank (default: CPU cores / hosts, at least 1)"
    )
    p.add_argument("--timeout", type=float, default=None, help="kill all ranks after this many seconds")
    p.add_argument("--tag", default=None, help="name prefix of the namespaces/links (default cs<pid>)")
    p.add_argument("-v", "--verbose", action="store_true", help="echo every ip/tc command")
    args = p.parse_args(argv)
    if not command:
        p.error("give the command to run after '--', e.g. -- python bench/allreduce_bw.py")
    rate = None if args.rate.lower() in ("none", "off", "0") else args.rate
    if rate is not None:
        try:
            parse_rate(rate)
        except argparse.ArgumentTypeError as exc:
            p.error(str(exc))
    threads = args.threads or max(1, (os.cpu_count() or 1) // (args.hosts * args.ranks_per_host))

    def on_signal(signum, frame):
        raise _Terminated(signum)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        preflight()
        with Cluster(args.hosts, rate, args.delay, args.subnet, args.tag, args.verbose, args.ranks_per_host) as cluster:
            print(
                f"[netsim] {args.hosts} hosts x {args.ranks_per_host} rank(s) on {args.subnet} "
                f"({', '.join(cluster.addresses)}), "
                f"link {rate or 'unshaped'}{', delay ' + args.delay if args.delay else ''}, "
                f"{threads} thread(s) per rank",
                file=sys.stderr,
            )
            return cluster.run(command, args.port, threads, args.timeout)
    except NetsimError as exc:
        print(f"netsim: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("[netsim] interrupted; cleaned up", file=sys.stderr)
        return 130
    except _Terminated as exc:
        print(f"[netsim] terminated by signal {exc.args[0]}; cleaned up", file=sys.stderr)
        return 128 + int(exc.args[0])
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""A simulated Ethernet cluster on one machine, for benchmarking collectives over a slow link.

    python bench/netsim.py --hosts 4 --rate 1gbit -- python bench/allreduce_bw.py
    python bench/netsim.py --hosts 2 --ranks-per-host 2 -- python bench/allreduce_bw.py
    python bench/netsim.py --hosts 4 --rate 1gbit --cpus-per-host 1 -- python bench/allreduce_bw.py
    python bench/netsim.py --hosts 4 --rate 100mbit --delay 20ms -- python bench/train_step.py

creates `--hosts` network namespaces joined through veth pairs, shapes every link with a tc tbf
at `--rate` on *both* ends of each veth, so that each host's link is limited in both directions,
like a host on a switch port. It then starts the command `--ranks-per-host` times (K, default 1)
per host inside its namespace with the torchrun environment (RANK = host * K + LOCAL_RANK,
WORLD_SIZE = hosts * K, LOCAL_RANK, LOCAL_WORLD_SIZE = K, GROUP_RANK = host, MASTER_ADDR = host
0, MASTER_PORT, GLOO_SOCKET_IFNAME = the namespace's interface), waits for all of them and exits
with the worst exit code. Namespaces, veths, the bridge or router, the delay line and the cgroups
are always removed: on success, failure, Ctrl-C or SIGTERM. A run killed outright (SIGKILL) cannot
clean up: the next run removes what earlier runs under the default names (`cs<pid>...`) left
behind once their <pid> is gone, and says what it removed.

Ranks of one host reach each other at the host's own address, which the kernel routes through
the namespace's loopback: traffic inside a host is unshaped (the fast intra-node link), traffic
between hosts crosses the shaped veths.

The network. Without `--delay` the hosts' veths hang on one Linux bridge. `--delay D` adds a
one-way delay D to every packet from one host to another (so a round trip between two hosts
takes 2D more than without it); it is the delay of the path between hosts, not of each link end.
The hosts then hang on a router namespace instead of the bridge, whose policy routing passes
every packet between hosts through a delay line (bench/netsim_delay.py: a process that holds
each packet for D between two TUN devices), since kernels without sch_netem cannot delay
packets otherwise. Links and TUN devices get an MTU of 64000 there, so packets are few.

The CPU (bench/netsim_cpu.py). Without `--cpus-per-host` the hosts share this machine's cores
freely (the plain, oversubscribed run). `--cpus-per-host C` emulates a cluster of hosts with C
cores each by time dilation (docs/guides/measuring.md): each host's processes get C cores' worth of CPU
time (a cgroup v1 CFS quota), and where hosts x C is more than this machine's cores the whole
cluster is slowed by d = hosts x C / cores: each host gets C / d of a core, links run at rate / d
and the delay lasts d times longer (`--dilate D` asks for a larger d). Each host's processes
also run on ceil(C) of the machine's cores only (their CPU affinity), the hosts spread evenly
over the cores, so that a host of one core never runs two of its ranks at once (where the hosts
cannot spread evenly at that d, they are not confined, and the banner says so). `--pin` instead
puts each host on C cores of its own (cpuset), undilated, where hosts x C fits: the reference
the emulation is measured against. Ranks get NETSIM_DILATION (d, 1 when not dilated) and
NETSIM_CPUS_PER_HOST (C, empty without it), beside NETSIM_RATE and NETSIM_DELAY (the emulated
cluster's rate and delay, as given): benchmarks report measured times divided by d as emulated
times (bench/emulation.py); ratios of two times need no rescaling.

Needs root and iproute2 (`ip`, `tc`); `--cpus-per-host` needs the cgroup v1 cpu (or, with
`--pin`, cpuset) controller, `--delay` needs /dev/net/tun. Traffic stays inside the namespaces
this program creates, on a private /24 of its own (`--subnet`, default 10.77.0.0/24; the bridge
and the router have no address on it, so the host's own network is never involved).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import ipaddress
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from netsim_cpu import CGROUP_ROOT, CpuError, CpuPlan, HostCgroups, cpu_snapshot, describe_cpu_use, plan, remove_cgroup
from units import parse_delay, parse_rate

DEFAULT_SUBNET = "10.77.0.0/24"
NS_IFNAME = "eth0"  # the interface's name inside every namespace
TAG_PIDS = 1_000_000  # the default tag is cs<pid % TAG_PIDS>: interface names are limited to 15 characters
DEFAULT_NAME = re.compile(r"cs(\d+)(?:-h\d+|-r|br|v\d+|p\d+)")
"""What a run under the default tag names: namespaces and cgroups cs<n>-h<i>, the router's
namespace cs<n>-r, the bridge cs<n>br, veths cs<n>v<i> and their peers cs<n>p<i>."""


class NetsimError(RuntimeError):
    """A clear, user-facing reason why the simulated cluster cannot be built."""


class _Terminated(BaseException):
    """Raised from the SIGTERM/SIGHUP handler so that `finally` blocks clean up."""


def tbf_burst_bytes(rate_bps: float) -> int:
    """Bucket size: 1 ms worth of traffic, and never below 256 KiB, so that one segmentation-
    offloaded super-packet (up to 64 KiB) always fits (tbf drops packets larger than its bucket)."""
    return max(256 * 1024, int(rate_bps / 8 * 1e-3))


# With a delay: the router's TUN devices into and out of the delay line, the routing table that
# sends hosts' packets into it, and the MTU of every link there (few, large packets).
DELAY_LINE = Path(__file__).resolve().parent / "netsim_delay.py"
DELAY_IN, DELAY_OUT, DELAY_TABLE = "dl-in", "dl-out", "100"
ROUTED_MTU = 64000


class Cluster:
    """N namespaces on a bridge (or, with a delay, on a router with a delay line), each host's
    processes in a cgroup of its own when its CPU is set. Use as a context manager: exiting
    always tears it all down."""

    def __init__(
        self,
        hosts: int,
        rate: str | None,
        delay: str | None = None,
        subnet: str = DEFAULT_SUBNET,
        tag: str | None = None,
        verbose: bool = False,
        ranks_per_host: int = 1,
        cpu: CpuPlan | None = None,
    ) -> None:
        if hosts < 1:
            raise NetsimError(f"--hosts must be at least 1, got {hosts}")
        if ranks_per_host < 1:
            raise NetsimError(f"--ranks-per-host must be at least 1, got {ranks_per_host}")
        try:
            net = private_network(subnet)
        except ValueError as exc:
            raise NetsimError(f"--subnet: {exc}") from None
        usable = list(net.hosts())
        if hosts > len(usable):
            raise NetsimError(f"{subnet} has room for {len(usable)} hosts, not {hosts}")
        self.hosts, self.rate, self.delay, self.verbose = hosts, rate, delay, verbose
        self.ranks_per_host = ranks_per_host
        self.cpu = cpu or plan(hosts, None)
        if self.cpu.hosts != hosts:
            raise NetsimError(f"the CPU plan is for {self.cpu.hosts} hosts, the cluster has {hosts}")
        self.delay_s = _delay_seconds(delay)
        self.prefixlen = net.prefixlen
        self.addresses = [str(a) for a in usable[:hosts]]
        # Short, unique names: interface names are limited to 15 characters.
        self.tag = tag or default_tag(os.getpid())
        self.bridge = f"{self.tag}br"
        self.router = f"{self.tag}-r"
        self.namespaces = [f"{self.tag}-h{i}" for i in range(hosts)]
        self.host_veths = [f"{self.tag}v{i}" for i in range(hosts)]
        self.cgroups = HostCgroups(self.cpu, self.namespaces)
        self._made_ns: list[str] = []
        self._made_links: list[str] = []
        self._delay_line: subprocess.Popen | None = None

    # -- what is emulated -----------------------------------------------------------------------
    @property
    def dilation(self) -> float:
        return self.cpu.dilation

    @property
    def routed(self) -> bool:
        """Whether the hosts hang on the router with the delay line (a delay was asked)."""
        return self.delay_s > 0

    @property
    def shaped_rate(self) -> str | None:
        """The rate tc shapes each link at: the emulated rate / d, in tc syntax."""
        if self.rate is None or self.dilation == 1:
            return self.rate
        return f"{int(parse_rate(self.rate) / self.dilation)}bit"

    @property
    def line_delay(self) -> float:
        """Seconds the delay line holds each packet: the emulated delay x d."""
        return self.delay_s * self.dilation

    def describe_network(self) -> str:
        """The links as emulated and as shaped, for the banner."""
        text = f"link {self.rate or 'unshaped'}"
        if self.rate is not None and self.dilation != 1:
            text += f" (shaped at {_rate_text(parse_rate(self.shaped_rate or ''))} = rate / d)"
        if self.routed:
            text += f", one-way delay {self.delay} between hosts (RTT +{2 * self.delay_s * 1e3:g} ms)"
            if self.dilation != 1:
                text += f" (held {self.line_delay * 1e3:g} ms = delay x d)"
        return text

    # -- plumbing -------------------------------------------------------------------------------
    def _ip(self, *args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
        cmd = ["ip"] + (["-n", ns] if ns else []) + list(args)
        return self._run(cmd, check)

    def _tc(self, *args: str, ns: str | None = None) -> subprocess.CompletedProcess:
        cmd = (["ip", "netns", "exec", ns] if ns else []) + ["tc"] + list(args)
        return self._run(cmd, True)

    def _sysctl(self, ns: str, *settings: str) -> None:
        self._run(["ip", "netns", "exec", ns, "sysctl", "-q", "-w", *settings], True)

    def _run(self, cmd: list[str], check: bool) -> subprocess.CompletedProcess:
        if self.verbose:
            print("[netsim] " + " ".join(cmd), file=sys.stderr)
        res = subprocess.run(cmd, capture_output=True, text=True)
        if check and res.returncode != 0:
            why = res.stderr.strip() or res.stdout.strip()
            if "qdisc kind is unknown" in why:
                why += " (this kernel lacks the qdisc module: sch_tbf for --rate)"
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
        try:
            self.cgroups.create()
        except (OSError, CpuError) as exc:
            raise NetsimError(f"cannot set up the hosts' CPU: {exc}") from None
        if self.routed:
            self._make_router()
        else:
            self._make_bridge()
        for host in range(self.hosts):
            self._add_host(host)

    def _make_bridge(self) -> None:
        self._ip("link", "add", self.bridge, "type", "bridge")
        self._made_links.append(self.bridge)
        self._ip("link", "set", self.bridge, "up")

    def _make_router(self) -> None:
        """The router namespace: forwarding on, and every packet from a host (rule per host,
        added by _attach_to_router) routed into the delay line, whose output it routes normally."""
        if not os.path.exists("/dev/net/tun"):
            raise NetsimError("--delay needs TUN devices and this system has no /dev/net/tun")
        r = self.router
        self._ip("netns", "add", r)
        self._made_ns.append(r)
        self._ip("link", "set", "lo", "up", ns=r)
        self._sysctl(r, "net.ipv4.ip_forward=1", "net.ipv4.conf.all.rp_filter=0", "net.ipv4.conf.default.rp_filter=0")
        for dev in (DELAY_IN, DELAY_OUT):
            self._ip("tuntap", "add", "dev", dev, "mode", "tun", ns=r)
            self._ip("link", "set", dev, "mtu", str(ROUTED_MTU), "up", ns=r)
        self._start_delay_line()
        self._ip("route", "add", "default", "dev", DELAY_IN, "table", DELAY_TABLE, ns=r)

    def _start_delay_line(self) -> None:
        cmd = ["ip", "netns", "exec", self.router, sys.executable, str(DELAY_LINE)]
        cmd += ["--src", DELAY_IN, "--dst", DELAY_OUT, "--delay", repr(self.line_delay)]
        if self.verbose:
            print("[netsim] " + " ".join(cmd), file=sys.stderr)
        self._delay_line = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True
        )
        assert self._delay_line.stdout is not None
        if self._delay_line.stdout.readline().strip() != "ready":
            raise NetsimError("the delay line (bench/netsim_delay.py) did not start; see its error above")

    def _add_host(self, i: int) -> None:
        ns, veth, addr, peer = self.namespaces[i], self.host_veths[i], self.addresses[i], f"{self.tag}p{i}"
        self._ip("netns", "add", ns)
        self._made_ns.append(ns)
        self._ip("link", "add", veth, "type", "veth", "peer", "name", peer)
        self._made_links.append(veth)
        self._ip("link", "set", peer, "netns", ns)
        self._ip("link", "set", peer, "name", NS_IFNAME, ns=ns)
        self._ip("addr", "add", f"{addr}/{self.prefixlen}", "dev", NS_IFNAME, ns=ns)
        if self.routed:
            self._ip("link", "set", NS_IFNAME, "mtu", str(ROUTED_MTU), ns=ns)
        self._ip("link", "set", NS_IFNAME, "up", ns=ns)
        self._ip("link", "set", "lo", "up", ns=ns)
        if self.routed:
            self._attach_to_router(veth, addr)
        else:
            self._ip("link", "set", veth, "master", self.bridge)
            self._ip("link", "set", veth, "up")
        self._shape(veth, self.router if self.routed else None)  # switch -> host (the host's download)
        self._shape(NS_IFNAME, ns)  # host -> switch (the host's upload)
        self._check_loopback(ns)

    def _attach_to_router(self, veth: str, addr: str) -> None:
        """Plug a host's veth into the router. The host keeps its /24 on eth0 and asks ARP for
        its peers; the router answers for them (proxy ARP, at once) and routes to each host by a
        /32 on its veth; what comes in from a host goes to the delay line (the rule)."""
        r = self.router
        self._ip("link", "set", veth, "netns", r)
        self._ip("link", "set", veth, "mtu", str(ROUTED_MTU), "up", ns=r)
        self._sysctl(r, f"net.ipv4.conf.{veth}.proxy_arp=1", f"net.ipv4.neigh.{veth}.proxy_delay=0")
        self._ip("route", "add", f"{addr}/32", "dev", veth, ns=r)
        self._ip("rule", "add", "iif", veth, "lookup", DELAY_TABLE, ns=r)

    def _shape(self, dev: str, ns: str | None) -> None:
        """A tbf at the shaped rate. Bytes are the same in the emulated cluster and the dilated
        one, times are d times longer: the bucket holds what the emulated link sends in 1 ms, the
        queue what it sends in 100 ms."""
        if self.rate is None:
            return
        burst = tbf_burst_bytes(parse_rate(self.rate))
        latency = f"{100 * self.dilation:g}ms"
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
            self.shaped_rate or self.rate,
            "burst",
            str(burst),
            "latency",
            latency,
            ns=ns,
        )

    def _check_loopback(self, ns: str) -> None:
        out = self._ip("-o", "link", "show", "lo", ns=ns).stdout
        flags = re.search(r"<([^>]*)>", out)
        if not flags or "UP" not in flags.group(1).split(","):
            raise NetsimError(f"loopback in namespace {ns} is not up: {out.strip()}")

    def teardown(self) -> None:
        """Remove everything this cluster made (idempotent; a second Ctrl-C cannot interrupt it)."""
        with _uninterrupted():
            self._teardown()

    def _teardown(self) -> None:
        self._stop_delay_line()
        self.cgroups.remove()  # kills what is left of the hosts' processes first
        for path in self.cgroups.leftovers():
            print(f"[netsim] could not remove cgroup {path}: remove it by hand (rmdir)", file=sys.stderr)
        for ns in reversed(self._made_ns):
            self._ip("netns", "del", ns, check=False)  # also destroys the veth pair inside
        for link in reversed(self._made_links):
            if subprocess.run(["ip", "link", "show", link], capture_output=True).returncode == 0:
                self._ip("link", "del", link, check=False)
        self._made_ns.clear()
        self._made_links.clear()

    def _stop_delay_line(self) -> None:
        """Close the delay line's input (it then prints its totals and exits); report them."""
        line, self._delay_line = self._delay_line, None
        if line is None:
            return
        try:
            totals, _ = line.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            _stop([line])
            totals = ""
        if totals.strip():
            print(f"[netsim] delay line: {totals.strip().splitlines()[-1]}", file=sys.stderr)

    def leftovers(self) -> list[str]:
        """Names of this cluster's namespaces/links/cgroups that still exist (empty after teardown)."""
        ns_list = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        present = {line.split()[0] for line in ns_list.splitlines() if line.strip()}
        left = [ns for ns in [*self.namespaces, self.router] if ns in present]
        links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
        left += [name for name in [self.bridge, *self.host_veths] if re.search(rf":\s{re.escape(name)}[@:]", links)]
        return left + self.cgroups.leftovers()

    # -- running --------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.hosts * self.ranks_per_host

    def environment(self, rank: int, port: int, threads: int) -> dict[str, str]:
        """torchrun's variables for global `rank` (host rank // K, local index rank % K), and
        what the ranks need to report emulated times."""
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
            NETSIM_DILATION=f"{self.dilation:g}",
            NETSIM_CPUS_PER_HOST="" if self.cpu.cpus_per_host is None else f"{self.cpu.cpus_per_host:g}",
            PYTHONUNBUFFERED="1",
        )
        return env

    def default_threads(self) -> int:
        """Threads per rank: the host's emulated cores shared by its ranks, else this machine's
        cores shared by all ranks; at least 1."""
        if self.cpu.cpus_per_host is not None:
            return max(1, int(self.cpu.cpus_per_host // self.ranks_per_host))
        return max(1, (os.cpu_count() or 1) // self.world_size)

    def run(
        self, command: list[str], port: int, threads: int, timeout: float | None = None, grace: float = 30.0
    ) -> int:
        """Start `command` K times on every host, wait for all; the worst exit code (0 if all succeeded).

        When one rank fails the others get `grace` seconds to finish before they are killed,
        so that a crashed rank never leaves its peers hanging in a collective. Then it says how
        much CPU the ranks used and how much went to anything else meanwhile: the emulation
        holds only while the rest of the machine stays within the cores the hosts leave free.
        """
        procs: list[subprocess.Popen] = []
        before = cpu_snapshot()
        try:
            for rank in range(self.world_size):
                host = rank // self.ranks_per_host
                procs.append(
                    subprocess.Popen(
                        ["ip", "netns", "exec", self.namespaces[host], *command],
                        env=self.environment(rank, port, threads),
                        start_new_session=True,
                        # into the host's cgroup before `ip netns exec` remounts /sys
                        preexec_fn=functools.partial(self.cgroups.enter, host) if self.cgroups.active else None,
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
            with _uninterrupted():  # a second Ctrl-C would leave the ranks running, orphaned
                _stop(procs)
        print(f"[netsim] CPU over the run: {describe_cpu_use(before, cpu_snapshot())}", file=sys.stderr)
        return worst_exit_code([p.returncode for p in procs])


def private_network(subnet: str) -> ipaddress.IPv4Network:
    """`subnet` as a network, where it is a private IPv4 one (else a ValueError saying why not)."""
    try:
        net = ipaddress.ip_network(subnet, strict=False)
    except ValueError:
        net = None
    if not isinstance(net, ipaddress.IPv4Network) or not net.is_private:
        raise ValueError(f"{subnet!r} is not a private IPv4 network such as {DEFAULT_SUBNET}")
    return net


def _subnet_argument(subnet: str) -> str:
    """argparse type of --subnet: refused as a usage error, before anything is built."""
    try:
        private_network(subnet)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return subnet


def default_tag(pid: int) -> str:
    """The name prefix of the cluster of netsim run `pid` when no --tag is given."""
    return f"cs{pid % TAG_PIDS}"


def stale_names(names: Iterable[str], alive: Callable[[int], bool]) -> list[str]:
    """Those of `names` that a run under the default tag cs<n> made (DEFAULT_NAME) and whose run is
    gone: `alive(n)` is false. Anything else, a --tag run's names included, is never picked."""
    return [name for name in names if (m := DEFAULT_NAME.fullmatch(name)) and not alive(int(m.group(1)))]


def live_tags() -> set[int]:
    """The n of the default tag cs<n> of every process running now. A run whose n is not among them
    is gone; a run whose pid went to another process keeps its names until that one ends too."""
    return {int(pid) % TAG_PIDS for pid in os.listdir("/proc") if pid.isdigit()}


def _link_names() -> list[str]:
    """The network interfaces of this namespace."""
    listed = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    return [m.group(1) for m in re.finditer(r"^\d+:\s+([^:@\s]+)", listed, re.M)]


def sweep_stale() -> list[str]:
    """Remove what netsim runs killed outright (SIGKILL: no teardown) left behind under the default
    tag, once their pid is gone: their namespaces (after killing their ranks and delay line, still
    running there), cgroups (after killing what runs in them), bridge and veths. What was removed."""
    alive = live_tags().__contains__
    swept = []
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    for ns in stale_names([line.split()[0] for line in listed.splitlines() if line.strip()], alive):
        pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        if subprocess.run(["ip", "netns", "del", ns], capture_output=True).returncode == 0:
            swept.append(f"namespace {ns}" + (f" (and the {len(pids)} process(es) still in it)" if pids else ""))
    for controller in ("cpu", "cpuset"):
        base = CGROUP_ROOT / controller
        found = [path.name for path in base.iterdir() if path.is_dir()] if base.is_dir() else []
        swept += [f"cgroup {base / name}" for name in stale_names(found, alive) if remove_cgroup(base / name)]
    links = stale_names(_link_names(), alive)
    for link in links:  # a veth's peer goes with it: a failed `del` may find it gone already
        subprocess.run(["ip", "link", "del", link], capture_output=True)
    left = set(_link_names())
    return swept + [f"link {link}" for link in links if link not in left]


def _delay_seconds(delay: str | None) -> float:
    """--delay in seconds (0 for none), as a NetsimError where it cannot be read."""
    if delay is None:
        return 0.0
    try:
        return parse_delay(delay)
    except ValueError as exc:
        raise NetsimError(str(exc)) from None


def _rate_text(bps: float) -> str:
    """A rate for people: 500Mbit, 2.5Gbit."""
    for unit, scale in (("Gbit", 1e9), ("Mbit", 1e6), ("Kbit", 1e3)):
        if bps >= scale:
            return f"{bps / scale:g}{unit}"
    return f"{bps:g}bit"


@contextlib.contextmanager
def _uninterrupted() -> Iterator[None]:
    """Hold off SIGINT, SIGTERM and SIGHUP (delivered when the block ends) while the ranks are
    stopped or the cluster is removed: a signal raising in between would skip the rest."""
    blocked = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


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


def build_parser() -> argparse.ArgumentParser:
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
    p.add_argument(
        "--delay",
        default=None,
        help="one-way delay between two hosts, e.g. 20ms (a round trip takes twice that more); through "
        "a delay line in a router namespace (default none)",
    )
    p.add_argument(
        "--cpus-per-host",
        type=float,
        default=None,
        metavar="C",
        help="emulate hosts of C cores each: a CPU quota per host, and time dilation d = hosts x C / "
        "cores where that exceeds this machine's cores (default: no quota, cores shared freely)",
    )
    p.add_argument(
        "--dilate",
        type=float,
        default=None,
        metavar="D",
        help="with --cpus-per-host: a dilation factor larger than needed (each host gets C / D of a core, "
        "links rate / D, delays x D), e.g. to compare with --pin",
    )
    p.add_argument(
        "--pin",
        action="store_true",
        help="with --cpus-per-host C: each host on C cores of its own, undilated (needs hosts x C <= cores)",
    )
    p.add_argument(
        "--subnet",
        type=_subnet_argument,
        default=DEFAULT_SUBNET,
        help=f"private /24 for the hosts (default {DEFAULT_SUBNET})",
    )
    p.add_argument("--port", type=_port_argument, default=29500, help="MASTER_PORT (default 29500)")
    p.add_argument(
        "--threads",
        type=_count_argument,
        default=None,
        help="OMP_NUM_THREADS per rank (default: the host's C cores / its ranks with --cpus-per-host, "
        "else CPU cores / ranks; at least 1)",
    )
    p.add_argument("--timeout", type=_seconds_argument, default=None, help="kill all ranks after this many seconds")
    p.add_argument(
        "--tag",
        type=_tag_argument,
        default=None,
        help="name prefix of the namespaces/links/cgroups (default cs<pid>, whose leftovers later runs sweep)",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="echo every ip/tc command")
    return p


def _count_argument(text: str) -> int:
    """argparse type of a count of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _port_argument(text: str) -> int:
    """argparse type of a TCP port the ranks can listen on."""
    value = int(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a TCP port is 1-65535, got {value}")
    return value


def _seconds_argument(text: str) -> float:
    """argparse type of a positive, finite number of seconds."""
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def _tag_argument(tag: str) -> str:
    """argparse type of --tag: any prefix but the default tags' form cs<digits>, which a later run
    would take for a gone run's and sweep while this one runs."""
    if re.fullmatch(r"cs\d+", tag):
        raise argparse.ArgumentTypeError(f"{tag}: cs<digits> is reserved for the default tags (cs<pid>)")
    return tag


def banner(cluster: Cluster, subnet: str, threads: int) -> str:
    """What is simulated, and how: addresses, links as emulated and as shaped, the CPU."""
    return (
        f"[netsim] {cluster.hosts} hosts x {cluster.ranks_per_host} rank(s) on {subnet} "
        f"({', '.join(cluster.addresses)}), {cluster.describe_network()}, {threads} thread(s) per rank\n"
        f"[netsim] CPU: {cluster.cpu.describe()}"
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" in argv:
        split = argv.index("--")
        argv, command = argv[:split], argv[split + 1 :]
    else:
        command = []
    p = build_parser()
    args = p.parse_args(argv)
    if not command:
        p.error("give the command to run after '--', e.g. -- python bench/allreduce_bw.py")
    rate = None if args.rate.lower() in ("none", "off", "0") else args.rate
    if rate is not None:
        try:
            parse_rate(rate)
        except argparse.ArgumentTypeError as exc:
            p.error(str(exc))
    delay = None if args.delay is None or args.delay.lower() in ("none", "off", "0") else args.delay
    try:
        cpu = plan(args.hosts, args.cpus_per_host, args.pin, args.dilate)
    except CpuError as exc:
        p.error(str(exc))

    def on_signal(signum, frame):
        raise _Terminated(signum)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        preflight()
        swept = sweep_stale()
        if swept:
            print(f"[netsim] removed what earlier runs, now gone, left: {', '.join(swept)}", file=sys.stderr)
        with Cluster(args.hosts, rate, delay, args.subnet, args.tag, args.verbose, args.ranks_per_host, cpu) as cluster:
            threads = args.threads or cluster.default_threads()
            print(banner(cluster, args.subnet, threads), file=sys.stderr)
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

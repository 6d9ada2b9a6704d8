"""The CPU of bench/netsim.py's simulated hosts: a quota per host (time dilation) or cores of its own.

A simulated host should compute as fast as the host it stands for. Sharing this machine's cores
freely, as the plain run does, gives every host whatever the scheduler leaves it, which makes the
CPU-bound parts of a collective look slower (or faster) than on a cluster. Two remedies:

- Time dilation (`--cpus-per-host C`): each host gets exactly C cores' worth of CPU time, a CFS
  quota on all its processes (cgroup v1 `cpu.cfs_quota_us`). Where hosts x C is more than this
  machine's cores, the whole cluster runs d = hosts x C / cores times slower than the one it stands
  for: each host gets C / d of a core, links carry rate / d and delays last d times longer. Every
  host then sees its cluster's ratio of compute to network, and a measured time divided by d is
  the emulated cluster's time. A quota bounds a host's CPU time, not how many of its threads run
  at once: a one-core host's two ranks would run side by side on two cores, then wait out the
  period, where a real one-core host interleaves them. So each host is also confined to ceil(C)
  cores (its processes' CPU affinity), the hosts spread evenly over the machine's cores; where
  they cannot be spread evenly at that d (3 hosts of one core on 2 cores), they are not confined,
  and the banner says so.
- Pinning (`--pin`): each host runs on C cores of its own (cgroup v1 cpuset), with no dilation.
  It only fits where hosts x C is at most this machine's cores; it is the reference the emulation
  is checked against.

What a quota cannot hold: the kernel's interrupt and softirq work (tbf releasing packets, the
veths' receive path) done while a core is otherwise idle is charged to no process, so dilated
hosts, which leave idle time on every core, get it for free where pinned hosts pay for it on
their own cores. At 10 Gbit/s that is about a fifth more CPU than the quota; netsim prints the
machine's CPU time not charged to the ranks after each run (bench/results/netsim_validation.txt).

The cgroups are named after the cluster (`<tag>-h<i>`, like its namespaces). A process must join
its host's cgroup before it enters the namespace: `ip netns exec` remounts /sys, so it could not
reach the cgroup files from inside. Its children inherit the membership.
"""

from __future__ import annotations

import math
import os
import resource
import signal
import time
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
# A short CFS period keeps a throttled host's CPU time smooth: with a quota of half a core it
# runs at most 5 ms before waiting 5 ms, not 50 ms before waiting 50 ms, which a latency-bound
# collective would notice as a stall the emulated host never has.
CFS_PERIOD_US = 10_000
CFS_MIN_QUOTA_US = 1_000  # the kernel refuses smaller quotas


class CpuError(RuntimeError):
    """A clear, user-facing reason why the hosts' CPU cannot be set up as asked."""


@dataclass(frozen=True)
class CpuPlan:
    """How the hosts share this machine's cores: the dilation and what each host gets."""

    hosts: int
    cpus_per_host: float | None  # None: no quota, the plain oversubscribed run
    cores: tuple[int, ...]  # the cores this process may run on
    dilation: float = 1.0
    pin: bool = False

    @property
    def quota_cores(self) -> float | None:
        """Cores' worth of CPU time each host gets (C / d); None where there is no quota."""
        if self.cpus_per_host is None or self.pin:
            return None
        return self.cpus_per_host / self.dilation

    @property
    def quota_us(self) -> int | None:
        """The host's cpu.cfs_quota_us for a period of CFS_PERIOD_US."""
        share = self.quota_cores
        return None if share is None else round(share * CFS_PERIOD_US)

    @property
    def confined(self) -> bool:
        """Whether each host runs on cores of its own (pinned) or confined to ceil(C) cores shared
        with other hosts: the latter where the hosts, placed round-robin, load no core beyond its
        whole time at this dilation."""
        if self.cpus_per_host is None:
            return False
        if self.pin:
            return True
        n, c = len(self.cores), self._cores_per_host
        most = math.ceil(self.hosts * c / n)  # hosts on the busiest core
        return most * self.cpus_per_host / (c * self.dilation) <= 1 + 1e-9

    @property
    def _cores_per_host(self) -> int:
        return min(math.ceil(self.cpus_per_host or 0), len(self.cores))

    def host_cores(self, host: int) -> list[int]:
        """The cores host `host` runs on: pinned, C consecutive ones of its own; confined, ceil(C)
        taken round-robin over the machine's; otherwise all of them."""
        if not self.confined:
            return list(self.cores)
        n, c = len(self.cores), self._cores_per_host
        if self.pin:
            return list(self.cores[host * c : (host + 1) * c])
        return sorted(self.cores[(host * c + i) % n] for i in range(c))

    def describe(self) -> str:
        """One line for netsim's banner."""
        if self.cpus_per_host is None:
            return "CPU shared freely by all hosts (no quota, no dilation)"
        if self.pin:
            where = "; ".join(f"host {h} on core(s) {_cpu_list(self.host_cores(h))}" for h in range(self.hosts))
            return f"pinned, {self.cpus_per_host:g} core(s) per host: {where}; no dilation (d = 1)"
        if self.confined:
            where = ", ".join(f"host {h} on {_cpu_list(self.host_cores(h))}" for h in range(self.hosts))
        else:
            where = "hosts not confined: they do not spread evenly over the cores at this d"
        return (
            f"emulating {self.hosts} hosts x {self.cpus_per_host:g} core(s) on {len(self.cores)} core(s): "
            f"dilation d = {self.dilation:g}, each host {self.quota_cores:g} core(s) "
            f"(cfs quota {self.quota_us} us per {CFS_PERIOD_US} us); {where}"
        )


def plan(
    hosts: int,
    cpus_per_host: float | None,
    pin: bool = False,
    dilate: float | None = None,
    cores: list[int] | None = None,
) -> CpuPlan:
    """Check the asked settings against this machine's cores and work out the dilation.

    d = hosts x C / cores where that is above 1, else 1; `dilate` asks for a larger d (to emulate
    a cluster that would fit, slowed down, e.g. to compare with the pinned run of it)."""
    available = tuple(sorted(os.sched_getaffinity(0) if cores is None else cores))
    if cpus_per_host is None:
        if pin or dilate is not None:
            raise CpuError("--pin and --dilate need --cpus-per-host C (the cores each simulated host has)")
        return CpuPlan(hosts, None, available)
    if not cpus_per_host > 0 or not math.isfinite(cpus_per_host):
        raise CpuError(f"--cpus-per-host must be a positive number of cores, got {cpus_per_host:g}")
    if dilate is not None and not (math.isfinite(dilate) and dilate > 0):
        raise CpuError(f"--dilate must be a positive number, got {dilate:g}")
    needed = hosts * cpus_per_host / len(available)
    if pin:
        return _pinned(hosts, cpus_per_host, available, dilate)
    dilation = max(1.0, needed) if dilate is None else dilate
    if dilation < max(1.0, needed) * (1 - 1e-9):
        raise CpuError(
            f"--dilate {dilation:g} is too small: {hosts} hosts x {cpus_per_host:g} core(s) on "
            f"{len(available)} core(s) need a dilation of at least {max(1.0, needed):g}"
        )
    result = CpuPlan(hosts, cpus_per_host, available, dilation)
    if (result.quota_us or 0) < CFS_MIN_QUOTA_US:
        raise CpuError(
            f"each host would get {result.quota_cores:g} of a core, below the kernel's smallest quota "
            f"({CFS_MIN_QUOTA_US} us per {CFS_PERIOD_US} us period); use fewer hosts or a smaller dilation"
        )
    return result


def _pinned(hosts: int, cpus_per_host: float, cores: tuple[int, ...], dilate: float | None) -> CpuPlan:
    """The plan of `--pin`: whole cores, all hosts side by side, never dilated."""
    if cpus_per_host != int(cpus_per_host):
        raise CpuError(f"--pin gives each host whole cores; --cpus-per-host {cpus_per_host:g} is not whole")
    if dilate not in (None, 1):
        raise CpuError("--pin runs undilated (each host on real cores of its own); drop --dilate")
    if hosts * cpus_per_host > len(cores):
        raise CpuError(
            f"--pin needs hosts x C = {hosts} x {cpus_per_host:g} cores, this machine has {len(cores)} "
            f"({_cpu_list(list(cores))}); drop --pin to emulate the cluster with time dilation"
        )
    return CpuPlan(hosts, cpus_per_host, cores, 1.0, pin=True)


def _cpu_list(cores: list[int]) -> str:
    return ",".join(str(c) for c in cores)


class HostCgroups:
    """One cgroup v1 per host, under the cpu controller (quota) or the cpuset one (pinning).

    Creation checks the controller is there; removal first kills whatever still runs in a host's
    cgroup (a rank's stray child that left its process group), since a cgroup with tasks cannot go.
    """

    def __init__(self, cpu_plan: CpuPlan, names: list[str], root: Path | None = None) -> None:
        self.plan = cpu_plan
        self.names = names
        self.controller = "cpuset" if cpu_plan.pin else "cpu"
        self.base = (root or CGROUP_ROOT) / self.controller
        self.made: list[Path] = []

    @property
    def active(self) -> bool:
        return self.plan.cpus_per_host is not None

    def dirs(self) -> list[Path]:
        return [self.base / name for name in self.names]

    def check(self) -> None:
        """Refuse clearly where this kernel has no cgroup v1 controller for what was asked."""
        probe = "cpuset.cpus" if self.plan.pin else "cpu.cfs_quota_us"
        if self.active and not (self.base / probe).exists():
            raise CpuError(
                f"--cpus-per-host needs the cgroup v1 {self.controller} controller at {self.base} "
                f"(no {self.base / probe}); cgroup v2-only systems are not supported"
            )

    def create(self) -> None:
        """Make every host's cgroup and set its quota or cores."""
        if not self.active:
            return
        self.check()
        for host, path in enumerate(self.dirs()):
            path.mkdir()
            self.made.append(path)
            if self.plan.pin:
                (path / "cpuset.cpus").write_text(_cpu_list(self.plan.host_cores(host)))
                (path / "cpuset.mems").write_text((self.base / "cpuset.mems").read_text().strip())
            else:
                (path / "cpu.cfs_period_us").write_text(str(CFS_PERIOD_US))
                (path / "cpu.cfs_quota_us").write_text(str(self.plan.quota_us))

    def enter(self, host: int) -> None:
        """Move the calling process into host `host`'s cgroup and onto its cores (run in the
        child before it execs; its children inherit both)."""
        if self.active:
            (self.dirs()[host] / "cgroup.procs").write_text(str(os.getpid()))
            os.sched_setaffinity(0, self.plan.host_cores(host))

    def remove(self, wait: float = 5.0) -> None:
        """Kill what is left in the cgroups, then remove them (idempotent)."""
        for path in reversed(self.made):
            remove_cgroup(path, wait)  # what stays is reported by leftovers()
        self.made = [path for path in self.made if path.exists()]

    def leftovers(self) -> list[str]:
        """This cluster's cgroups that still exist (empty after remove())."""
        return [str(path) for path in self.dirs() if path.exists()]


def remove_cgroup(path: Path, wait: float = 5.0) -> bool:
    """Kill whatever runs in the cgroup at `path`, then remove it: a cgroup with tasks cannot go.
    Whether it is gone, after at most `wait` seconds for the killed tasks to exit."""
    deadline = time.monotonic() + wait
    while path.exists():
        _kill_all(path)
        try:
            path.rmdir()
        except OSError:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)
    return True


def _kill_all(path: Path) -> None:
    try:
        pids = [int(p) for p in (path / "cgroup.procs").read_text().split()]
    except OSError:
        return
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def cpu_snapshot() -> tuple[float, float, float]:
    """(this machine's busy CPU seconds, all its CPU seconds, those of this process's reaped
    children) so far: two snapshots around a run tell what its ranks used and what else ran."""
    fields = [float(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    idle = fields[3] + fields[4]  # idle, iowait (guest time is already inside user)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    tick = os.sysconf("SC_CLK_TCK")
    return (sum(fields) - idle) / tick, sum(fields) / tick, children.ru_utime + children.ru_stime


def describe_cpu_use(before: tuple[float, float, float], after: tuple[float, float, float]) -> str:
    """The ranks' CPU time beside the machine's: what the rest (other processes, the kernel's
    own threads, netsim) took is CPU the emulated hosts could have lost to it."""
    busy, total, ranks = (b - a for a, b in zip(before, after))
    return (
        f"ranks {ranks:.1f} s, the machine busy {busy:.1f} s of {total:.1f} s, "
        f"{max(0.0, busy - ranks):.1f} s of it by anything else (other processes, kernel threads, netsim)"
    )

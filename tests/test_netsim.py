"""bench/netsim.py: a 2-host shaped cluster runs a gloo all_reduce and leaves nothing behind;
with several ranks per host, ranks of one host talk over its loopback and only traffic between
hosts crosses the shaped interface. The emulated cluster (--cpus-per-host): each host's CPU time
is capped at C / d of a core, its links shaped at rate / d and the delay line's delay stretched
by d; --pin puts each host on a core of its own; the delay line delays each packet between hosts
by --delay; cgroups, namespaces and the delay line are gone afterwards, whatever happened.

Needs root and iproute2 (ip, tc) with sch_tbf; skipped with the reason otherwise. The tests that
build namespaces carry the `netns` marker (run them with `pytest -m netns`).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import bench_scripts

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "netsim.py"
# NETSIM_TEST_TAG: the name prefix of what the tests build, so that runs side by side never meet.
TAG = os.environ.get("NETSIM_TEST_TAG", "cst") + str(os.getpid() % 100000)

ALLREDUCE = """
import os, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.full((1000,), float(dist.get_rank() + 1))
dist.all_reduce(t)
assert t.eq(sum(range(1, dist.get_world_size() + 1))).all(), t[:4]
assert os.environ["GLOO_SOCKET_IFNAME"] == "eth0" and os.environ["LOCAL_RANK"] == "0"
assert os.environ["OMP_NUM_THREADS"] == "1" and os.environ["MASTER_ADDR"] == "10.77.5.1"
os.write(1, f"rank {dist.get_rank()} ok\\n".encode())  # one write: ranks share stdout
dist.destroy_process_group()
"""


def _load():
    return bench_scripts.load("netsim")


def _why_skip() -> str | None:
    if sys.platform != "linux":
        return "netsim needs Linux"
    if os.geteuid() != 0:
        return "netsim needs root (network namespaces)"
    missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
    if missing:
        return f"netsim needs iproute2: missing {missing}"
    probe = subprocess.run(["ip", "netns", "add", f"{TAG}-probe"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"cannot create network namespaces here: {probe.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", f"{TAG}-probe"], capture_output=True)
    return None


SKIP = _why_skip()


def needs_netns(test):
    """Marked `netns` (pytest -m netns runs these alone); skipped with the reason where
    namespaces cannot be made."""
    return pytest.mark.netns(pytest.mark.skipif(SKIP is not None, reason=SKIP or "")(test))


def _leftovers(tag: str) -> list[str]:
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    cgroups = [str(p) for c in ("cpu", "cpuset") for p in Path("/sys/fs/cgroup", c).glob(f"{tag}-*")]
    return [line for line in (ns + links).splitlines() if tag in line] + cgroups


def _netsim(tag: str, *command: str, extra=(), subnet: str = "10.77.5.0/24", hosts: int = 2) -> list[str]:
    return [
        sys.executable,
        str(SCRIPT),
        "--hosts",
        str(hosts),
        "--rate",
        "1gbit",
        "--subnet",
        subnet,
        "--tag",
        tag,
        "--threads",
        "1",
        *extra,
        "--",
        *command,
    ]


RANKS_PER_HOST = """
import os, torch, torch.distributed as dist
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
k, host, local = int(os.environ["LOCAL_WORLD_SIZE"]), int(os.environ["GROUP_RANK"]), int(os.environ["LOCAL_RANK"])
assert (world, k, os.environ["GROUP_WORLD_SIZE"]) == (6, 3, "2") and rank == host * k + local, dict(os.environ)
nodes = [dist.new_group([h * k + i for i in range(k)]) for h in range(2)]
peers = [dist.new_group([h * k + i for h in range(2)]) for i in range(k)]

def sent():  # bytes that left this namespace through the shaped interface, and through loopback
    read = lambda dev: int(open(f"/sys/class/net/{dev}/statistics/tx_bytes").read())
    return read("eth0"), read("lo")

payload = 4 << 20  # floats: 16 MiB per all_reduce
dist.barrier()
eth0, lo = sent()
t = torch.full((payload,), float(rank))
dist.all_reduce(t, group=nodes[host])  # inside the host
assert t.eq(sum(range(host * k, host * k + k))).all()
dist.barrier()
eth1, lo1 = sent()
dist.all_reduce(t, group=peers[local])  # across hosts
dist.barrier()
eth2, _ = sent()
dist.barrier()
assert eth1 - eth0 < (1 << 20) and lo1 - lo > (8 << 20), (eth1 - eth0, lo1 - lo)
assert eth2 - eth1 > (8 << 20), eth2 - eth1
os.write(1, f"rank {rank} host {host} ok\\n".encode())
dist.destroy_process_group()
"""


def test_rate_parsing_and_exit_codes():
    netsim = _load()
    assert netsim.parse_rate("1gbit") == 1e9 and netsim.parse_rate("100mbit") == 1e8
    assert netsim.parse_rate("125mbps") == 1e9
    assert netsim.tbf_burst_bytes(10e9) == 1_250_000 and netsim.tbf_burst_bytes(1e6) == 256 * 1024
    assert netsim.worst_exit_code([0, 0]) == 0
    assert netsim.worst_exit_code([0, 3, 1]) == 3
    assert netsim.worst_exit_code([0, -15]) == 143


def test_refuses_without_root(monkeypatch):
    netsim = _load()
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(netsim.NetsimError, match="root"):
        netsim.preflight()
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(shutil, "which", lambda tool: None)
    with pytest.raises(netsim.NetsimError, match="iproute2"):
        netsim.preflight()


@needs_netns
def test_two_hosts_allreduce_and_cleanup():
    tag = TAG + "a"
    proc = subprocess.run(
        _netsim(tag, sys.executable, "-c", ALLREDUCE), cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "rank 0 ok" in proc.stdout and "rank 1 ok" in proc.stdout
    assert _leftovers(tag) == []


@needs_netns
def test_ranks_per_host_share_loopback_and_cross_the_shaped_link():
    """3 ranks on each of 2 hosts: torchrun's variables are set per rank, an all_reduce inside a
    host sends nothing through the host's shaped interface, one across hosts does."""
    tag = TAG + "k"
    proc = subprocess.run(
        _netsim(tag, sys.executable, "-c", RANKS_PER_HOST, extra=("--ranks-per-host", "3"), subnet="10.77.13.0/24"),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert all(f"rank {r} host {r // 3} ok" in proc.stdout for r in range(6)), proc.stdout + proc.stderr
    assert _leftovers(tag) == []


@needs_netns
def test_failure_gives_worst_code_and_cleans_up():
    tag = TAG + "b"
    script = "import os, sys; sys.exit(3 if os.environ['RANK'] == '1' else 0)"
    proc = subprocess.run(
        _netsim(tag, sys.executable, "-c", script), cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert _leftovers(tag) == []


def _pids_in(ns: str) -> list[int]:
    return [int(p) for p in subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()]


@needs_netns
@pytest.mark.parametrize(
    "extra", [(), ("--cpus-per-host", "1", "--dilate", "2", "--delay", "5ms")], ids=["plain", "emulated-delayed"]
)
def test_sigterm_cleans_up(extra):
    """SIGTERM while the ranks run: namespaces, links, cgroups and the delay line all go."""
    tag = TAG + "c" + str(len(extra))
    proc = subprocess.Popen(
        _netsim(tag, "sleep", "60", extra=extra), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 20
        while not _pids_in(f"{tag}-h1") and time.monotonic() < deadline:  # the last rank runs
            time.sleep(0.1)
        delay_line = _pids_in(f"{tag}-r")
        assert bool(delay_line) == bool(extra), delay_line
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr.read()
    assert _leftovers(tag) == []
    assert not [pid for pid in delay_line if Path(f"/proc/{pid}").exists()], "the delay line still runs"


STUBBORN = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"


@needs_netns
def test_a_second_ctrl_c_while_the_ranks_stop_still_kills_them():
    """Ranks that ignore SIGTERM get SIGKILL 5 s later; a second Ctrl-C within those 5 s
    interrupted the stopping, and the ranks ran on, orphaned, while netsim said it had cleaned up."""
    tag = TAG + "i"
    proc = subprocess.Popen(
        _netsim(tag, sys.executable, "-c", STUBBORN),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # Ctrl-C's default, also where this test runs in a background job (whose SIGINT is ignored,
        # and Python then leaves it so)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = time.monotonic() + 20
        while len(_pids_in(f"{tag}-h1")) < 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        ranks = _pids_in(f"{tag}-h0") + _pids_in(f"{tag}-h1")
        assert ranks
        time.sleep(1.0)  # the ranks have set their SIGTERM handler
        proc.send_signal(signal.SIGINT)
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)
        proc.wait(30)
    finally:
        if proc.poll() is None:  # netsim cleans up on SIGTERM; SIGKILL would leave its namespaces
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    assert proc.returncode == 130, proc.stderr.read()
    assert not [pid for pid in ranks if Path(f"/proc/{pid}").exists()], "a rank still runs"
    assert _leftovers(tag) == []


# ---------------------------------------------------------------------------------------------
# the emulated cluster: CPU quota and time dilation, pinning, the delay line


def _cpu():
    _load()  # puts bench/ on sys.path
    import netsim_cpu

    return netsim_cpu


def test_cpu_plan_dilates_where_the_hosts_need_more_cores():
    cpu = _cpu()
    two = [0, 1]
    fits = cpu.plan(2, 1, cores=two)
    assert (fits.dilation, fits.quota_cores, fits.quota_us) == (1, 1, cpu.CFS_PERIOD_US)
    four = cpu.plan(4, 1, cores=two)
    assert (four.dilation, four.quota_cores, four.quota_us) == (2, 0.5, cpu.CFS_PERIOD_US // 2)
    assert cpu.plan(3, 1, cores=two).dilation == 1.5 and cpu.plan(2, 2, cores=two).quota_cores == 1
    forced = cpu.plan(2, 1, dilate=2, cores=two)
    assert (forced.dilation, forced.quota_cores) == (2, 0.5)
    pinned = cpu.plan(2, 1, pin=True, cores=[4, 6])
    assert pinned.dilation == 1 and pinned.quota_us is None and pinned.host_cores(1) == [6]
    assert cpu.plan(4, None, cores=two).quota_us is None and cpu.plan(4, None, cores=two).dilation == 1


def test_emulated_hosts_are_confined_to_their_cores_where_they_spread_evenly():
    """A quota bounds a host's CPU time, not how many of its threads run at once: a one-core
    host's two ranks ran side by side on two cores, then waited out the period. Each host is
    confined to ceil(C) cores, round-robin, where no core is then loaded beyond its time."""
    cpu = _cpu()
    two = [0, 1]
    four = cpu.plan(4, 1, cores=two)
    assert four.confined and [four.host_cores(h) for h in range(4)] == [[0], [1], [0], [1]]
    forced = cpu.plan(2, 1, dilate=2, cores=[4, 6])
    assert forced.confined and [forced.host_cores(h) for h in range(2)] == [[4], [6]]
    assert "host 0 on 4, host 1 on 6" in forced.describe()
    both = cpu.plan(2, 2, cores=two)
    assert both.confined and both.host_cores(1) == [0, 1]
    halves = cpu.plan(8, 0.5, cores=two)  # 4 half-core hosts on each core, d = 2
    assert halves.dilation == 2 and halves.confined and halves.host_cores(5) == [1]
    uneven = cpu.plan(3, 1, cores=two)  # d = 1.5: two hosts of 2/3 of a core cannot share one
    assert not uneven.confined and uneven.host_cores(2) == [0, 1] and "not confined" in uneven.describe()
    assert not cpu.plan(4, None, cores=two).confined and cpu.plan(2, 1, pin=True, cores=two).confined


@pytest.mark.parametrize(
    "kwargs, why",
    [
        (dict(hosts=2, cpus_per_host=0), "positive"),
        (dict(hosts=2, cpus_per_host=-1), "positive"),
        (dict(hosts=3, cpus_per_host=1, pin=True), "--pin needs hosts x C = 3 x 1 cores, this machine has 2"),
        (dict(hosts=2, cpus_per_host=0.5, pin=True), "whole cores"),
        (dict(hosts=2, cpus_per_host=1, pin=True, dilate=2), "drop --dilate"),
        (dict(hosts=4, cpus_per_host=1, dilate=1.5), "at least 2"),
        (dict(hosts=2, cpus_per_host=None, dilate=2), "need --cpus-per-host"),
        (dict(hosts=2, cpus_per_host=None, pin=True), "need --cpus-per-host"),
        (dict(hosts=2, cpus_per_host=0.01), "smallest quota"),
        (dict(hosts=2, cpus_per_host=1, dilate=float("nan")), "--dilate must be a positive number, got nan"),
    ],
)
def test_cpu_plan_refuses_impossible_settings(kwargs, why):
    cpu = _cpu()
    with pytest.raises(cpu.CpuError, match=re.escape(why)):
        cpu.plan(cores=[0, 1], **kwargs)


@pytest.mark.parametrize(
    "args, says",
    [
        (["--threads", "-3"], "argument --threads: must be at least 1, got -3"),
        (["--port", "70000"], "argument --port: a TCP port is 1-65535, got 70000"),
        (["--timeout", "-1"], "argument --timeout: must be a positive number of seconds, got -1"),
        (["--timeout", "nan"], "argument --timeout: must be a positive number of seconds, got nan"),
    ],
)
def test_cli_refuses_counts_ports_and_timeouts_that_cannot_be(capsys, args, says):
    """They were passed on unchecked: OMP_NUM_THREADS=-3 to the ranks, a port no rank can bind,
    a timeout that killed the ranks at once."""
    netsim = _load()
    with pytest.raises(SystemExit) as exit_info:
        netsim.main(["--hosts", "2", *args, "--", "true"])
    assert exit_info.value.code == 2 and says in capsys.readouterr().err


def test_cli_refuses_pin_beyond_this_machines_cores(capsys):
    netsim = _load()
    hosts = len(os.sched_getaffinity(0)) + 1
    with pytest.raises(SystemExit) as exit_info:
        netsim.main(["--hosts", str(hosts), "--cpus-per-host", "1", "--pin", "--", "true"])
    assert exit_info.value.code == 2 and "--pin needs hosts x C" in capsys.readouterr().err


def test_no_cgroup_v1_controller_is_a_clear_error(tmp_path, monkeypatch):
    """Where /sys/fs/cgroup has no v1 cpu controller, the cluster refuses before building anything."""
    netsim, cpu = _load(), _cpu()
    monkeypatch.setattr(cpu, "CGROUP_ROOT", tmp_path)
    cluster = netsim.Cluster(2, "1gbit", tag="nsenone", cpu=cpu.plan(2, 1, dilate=2))
    with pytest.raises(netsim.NetsimError, match="cgroup v1 cpu controller"):
        with cluster:
            pass
    assert list(tmp_path.iterdir()) == []


def test_parse_delay():
    _load()
    from units import parse_delay

    assert parse_delay("20ms") == pytest.approx(0.02) and parse_delay("0.1ms") == pytest.approx(1e-4)
    assert parse_delay("500us") == pytest.approx(5e-4) and parse_delay("1s") == 1.0
    for bad in ("20", "ms", "20 parsecs", "-1ms"):
        with pytest.raises(ValueError, match="unit"):
            parse_delay(bad)


def test_delay_line_holds_each_packet_for_the_delay_in_order():
    """The forwarder's queue on a fake clock, with datagram sockets standing in for the TUNs."""
    import socket

    _load()
    from netsim_delay import DelayLine

    now = [100.0]
    src_in, src = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    dst, dst_out = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    for sock in (src, dst_out):
        sock.setblocking(False)
    line = DelayLine(src.fileno(), dst.fileno(), 0.02, clock=lambda: now[0])
    assert line.timeout() is None
    src_in.send(b"first")
    line.take()
    now[0] += 0.01
    src_in.send(b"second")
    line.take()
    assert line.timeout() == pytest.approx(0.01)
    line.release()
    with pytest.raises(BlockingIOError):
        dst_out.recv(100)
    now[0] += 0.01
    line.release()
    assert dst_out.recv(100) == b"first" and line.timeout() == pytest.approx(0.01)
    now[0] += 0.01
    line.release()
    assert dst_out.recv(100) == b"second" and (line.packets, line.bytes) == (2, 11)
    for _ in range(100):  # timed waits that return 1 ms late: packets then leave 1 ms early
        line.observe_lateness(0.001)
    src_in.send(b"third")
    line.take()
    assert line.lateness == pytest.approx(0.001, rel=1e-3) and line.timeout() == pytest.approx(0.019, rel=1e-3)
    now[0] += 0.0185
    line.release()
    with pytest.raises(BlockingIOError):
        dst_out.recv(100)
    now[0] += 0.001
    line.release()
    assert dst_out.recv(100) == b"third"
    for sock in (src_in, src, dst, dst_out):
        sock.close()


# bench/link_probe.py's TCP round trip, rank 0 serving, rank 1 measuring (the median, in seconds).
PING = """
import os, statistics, sys
sys.path.insert(0, "bench")
import link_probe

def ping(n):
    addr = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]) + 1)
    if os.environ["RANK"] == "0":
        return link_probe.serve(addr)
    return statistics.median(link_probe.probe(addr, n, 0)[0])
"""

EMULATED = (
    PING
    + """
import subprocess, time
rank, host = os.environ["RANK"], os.environ["GROUP_RANK"]
rtt = ping(8)
start, cpu = time.perf_counter(), time.process_time()
while time.perf_counter() - start < 1.0:  # busy for a second of wall time
    pass
cpu = (time.process_time() - cpu) / (time.perf_counter() - start)
cgroup = [line.split(":")[2].strip() for line in open("/proc/self/cgroup") if line.split(":")[1] == "cpu"][0]
qdisc = subprocess.run(["tc", "qdisc", "show", "dev", "eth0"], capture_output=True, text=True).stdout.split()
rate = qdisc[qdisc.index("rate") + 1]
env = os.environ["NETSIM_DILATION"], os.environ["NETSIM_CPUS_PER_HOST"], os.environ["NETSIM_RATE"]
os.write(1, f"rank {rank} cpu {cpu:.3f} cgroup {cgroup} rate {rate} env {env} rtt {rtt}\\n".encode())
"""
)


def _run(tag: str, script: str, extra: tuple[str, ...], subnet: str = "10.77.5.0/24") -> subprocess.CompletedProcess:
    """`python -c script` on each of 2 hosts of a netsim cluster with `extra` options."""
    return subprocess.run(
        _netsim(tag, sys.executable, "-c", script, extra=extra, subnet=subnet),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def _rank_lines(out: str) -> dict[int, list[str]]:
    return {int(line.split()[1]): line.split() for line in out.splitlines() if line.startswith("rank ")}


@needs_netns
def test_emulated_hosts_get_c_over_d_of_a_core_and_links_rate_over_d():
    """2 hosts of 1 core dilated 4x: a busy rank gets a quarter of a core, the links are shaped at
    250 Mbit/s for the emulated 1 Gbit/s, the 5 ms delay is held 20 ms (a 40 ms round trip), and
    the ranks are told d."""
    tag = TAG + "q"
    extra = ("--cpus-per-host", "1", "--dilate", "4", "--delay", "5ms")
    proc = _run(tag, EMULATED, extra, "10.77.61.0/24")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ranks = _rank_lines(proc.stdout)
    assert sorted(ranks) == [0, 1], proc.stdout + proc.stderr
    for rank, words in ranks.items():
        cpu = float(words[3])
        assert 0.05 < cpu < 0.25 * 1.15, f"rank {rank} got {cpu:.3f} of a core, quota 0.25"
        assert words[5] == f"/{tag}-h{rank}" and words[7] == "250Mbit", words
        assert " ".join(words[9:12]) == "('4', '1', '1gbit')", words
    rtt = float(ranks[1][13])
    assert 0.040 <= rtt < 0.040 * 1.2 + 0.005, f"round trip {rtt * 1e3:.1f} ms, expected 40 ms (2 x 5 ms x d)"
    assert "dilation d = 4" in proc.stderr and "shaped at 250Mbit" in proc.stderr
    assert _leftovers(tag) == []


PINNED = """
import os
allowed = [line.split()[1] for line in open("/proc/self/status") if line.startswith("Cpus_allowed_list")][0]
os.write(1, f"rank {os.environ['RANK']} cores {allowed} d {os.environ['NETSIM_DILATION']}\\n".encode())
"""


@needs_netns
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="--pin of 2 one-core hosts needs 2 cores")
def test_pin_puts_each_host_on_a_core_of_its_own():
    tag = TAG + "p"
    proc = _run(tag, PINNED, ("--cpus-per-host", "1", "--pin"), "10.77.62.0/24")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    cores = sorted(os.sched_getaffinity(0))
    ranks = _rank_lines(proc.stdout)
    assert {r: (w[3], w[5]) for r, w in ranks.items()} == {0: (str(cores[0]), "1"), 1: (str(cores[1]), "1")}
    assert _leftovers(tag) == []


@needs_netns
@pytest.mark.skipif(len(os.sched_getaffinity(0)) == 3, reason="4 one-core hosts do not spread evenly over 3 cores")
def test_emulated_hosts_run_on_their_cores():
    """4 hosts of 1 core on this machine's cores: each host's two ranks on one core, the hosts
    spread over the cores (two on each of 2 cores, d = 2)."""
    tag = TAG + "w"
    cores = sorted(os.sched_getaffinity(0))
    extra = ("--cpus-per-host", "1", "--ranks-per-host", "2")
    proc = subprocess.run(
        _netsim(tag, sys.executable, "-c", PINNED, extra=extra, subnet="10.77.66.0/24", hosts=4),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ranks = _rank_lines(proc.stdout)
    assert {r: w[3] for r, w in ranks.items()} == {r: str(cores[(r // 2) % len(cores)]) for r in range(8)}, ranks
    assert _leftovers(tag) == []


STRAY = """
import os, subprocess, sys
if os.environ["RANK"] == "1":  # a child that leaves the rank's process group, then the rank fails
    stray = subprocess.Popen(["sleep", "60"], start_new_session=True)
    os.write(1, f"stray {stray.pid}\\n".encode())
    sys.exit(3)
"""


@needs_netns
def test_failed_rank_and_its_stray_child_leave_no_cgroup():
    """A failing rank's detached child would keep its host's cgroup alive: netsim kills it."""
    tag = TAG + "f"
    proc = _run(tag, STRAY, ("--cpus-per-host", "1", "--dilate", "2"), "10.77.64.0/24")
    assert proc.returncode == 3, proc.stdout + proc.stderr
    stray = int(proc.stdout.split("stray ")[1].split()[0])
    assert _leftovers(tag) == []
    status = Path(f"/proc/{stray}/status")
    assert not status.exists() or "State:\tZ" in status.read_text(), "the stray child still runs"


DELAYED = (
    PING
    + """
import torch, torch.distributed as dist
rtt = ping(10)
dist.init_process_group("gloo")
t = torch.full((1 << 18,), float(dist.get_rank() + 1))
dist.all_reduce(t)
assert t.eq(3).all(), t[:4]
os.write(1, f"rank {dist.get_rank()} ok rtt {rtt}\\n".encode())
dist.destroy_process_group()
"""
)


@needs_netns
def test_delay_line_adds_the_one_way_delay_and_carries_gloo():
    """--delay 10ms: a TCP round trip between the hosts takes 20 ms (plus little), and a gloo
    all_reduce of 1 MiB crosses the router and the delay line."""
    tag = TAG + "d"
    extra = ("--rate", "100mbit", "--delay", "10ms")
    proc = _run(tag, DELAYED, extra, "10.77.63.0/24")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ranks = _rank_lines(proc.stdout)
    assert sorted(ranks) == [0, 1] and ranks[0][2] == "ok", proc.stdout + proc.stderr
    rtt = float(ranks[1][4])
    assert 0.020 <= rtt < 0.020 * 1.2 + 0.002, f"round trip {rtt * 1e3:.2f} ms, expected 20 ms"
    assert "[netsim] delay line:" in proc.stderr and _leftovers(tag) == []

"""bench/netsim.py: a 2-host shaped cluster runs a gloo all_reduce and leaves nothing behind;
with several ranks per host, ranks of one host talk over its loopback and only traffic between
hosts crosses the shaped interface.

Needs root and iproute2 (ip, tc) with sch_tbf; skipped with the reason otherwise. The tests that
build namespaces carry the `netns` marker (run them with `pytest -m netns`).
"""

from __future__ import annotations

import os
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
TAG = f"cst{os.getpid() % 100000}"

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
    return [line for line in (ns + links).splitlines() if tag in line]


def _netsim(tag: str, *command: str, extra=(), subnet: str = "10.77.5.0/24") -> list[str]:
    return [
        sys.executable,
        str(SCRIPT),
        "--hosts",
        "2",
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


@needs_netns
def test_sigterm_cleans_up():
    tag = TAG + "c"
    proc = subprocess.Popen(
        _netsim(tag, "sleep", "60"), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 20
        while len([x for x in _leftovers(tag) if "-h1" in x]) == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr.read()
    assert _leftovers(tag) == []

"""The command lines of bench/convergence.py, bench/soak.py, bench/cost_model.py and bench/netsim.py:
a setting that cannot work is a usage error (exit 2, naming the option or file) before any rank
starts, a trial run never writes over the recorded results, and netsim sweeps what runs killed
outright (SIGKILL) left behind, and only that.

The programs run in this process (`main(argv)`), their ranks replaced by a stand-in that fails
the test if it is reached. The sweep of real namespaces carries the `netns` marker."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import bench_scripts

ROOT = Path(__file__).resolve().parents[1]


def _no_ranks(*args, **kwargs):
    raise AssertionError("the ranks started: the settings should have been refused first")


def _refused(main, argv: list[str], capsys) -> str:
    """`main(argv)` exits with argparse's usage error; what it printed on stderr."""
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    return capsys.readouterr().err


# ------------------------------------------------------------------ convergence.py


def test_convergence_writes_a_trial_run_outside_the_repository(monkeypatch, tmp_path):
    """Without --out the report goes to a new temporary directory, never over bench/results'."""
    cv = bench_scripts.load("convergence")
    written = []
    result = {"name": "adam", "final_val_loss": 2.0, "bytes_sent": 1000}
    monkeypatch.setattr(cv, "run_ranks", lambda *args: ([result], 4))
    monkeypatch.setattr(cv, "write_outputs", lambda report, out: written.append(Path(out)))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    cv.main(["--runs", "adam", "--steps", "20"])
    (out,) = written
    assert out.parent == tmp_path and out.is_dir() and not out.is_relative_to(ROOT)


@pytest.mark.parametrize(
    "argv, why",
    [
        (["--steps", "0"], "--steps must be at least 1"),
        (["--eval-every", "0"], "--eval-every must be at least 1"),
        (["--warmup", "1.5"], "--warmup"),
        (["--warmup", "-0.1"], "--warmup"),
        (["--world-size", "0"], "--world-size must be at least 1"),
        (["--out", "FILE"], "argument --out"),
    ],
    ids=["steps", "eval-every", "warmup-above", "warmup-below", "world-size", "out-is-a-file"],
)
def test_convergence_refuses_before_training(argv, why, monkeypatch, tmp_path, capsys):
    cv = bench_scripts.load("convergence")
    monkeypatch.setattr(cv, "run_ranks", _no_ranks)
    (tmp_path / "FILE").write_text("not a directory\n")
    argv = [str(tmp_path / a) if a == "FILE" else a for a in argv]
    assert why in _refused(cv.main, argv, capsys)


# ------------------------------------------------------------------ soak.py


@pytest.mark.parametrize(
    "argv, option",
    [
        (["--every", "0"], "--every"),
        (["--numel", "0"], "--numel"),
        (["--numel", "-5"], "--numel"),
        (["--nprocs", "0"], "--nprocs"),
        (["--max-rss-growth-mib", "nan"], "--max-rss-growth-mib"),
    ],
    ids=["every", "numel-zero", "numel-negative", "nprocs", "rss-nan"],
)
def test_soak_refuses_before_the_ranks_start(argv, option, monkeypatch, capsys):
    soak = bench_scripts.load("soak")
    monkeypatch.setattr(soak, "run_ranks", _no_ranks)
    assert option in _refused(soak.main, ["--calls", "10", "--every", "10", *argv], capsys)


# ------------------------------------------------------------------ cost_model.py


def test_cost_model_names_a_file_it_cannot_use(tmp_path, capsys):
    model = bench_scripts.load("cost_model")
    (tmp_path / "text.json").write_text("size time\n1 2\n")
    allreduce_bw = [{"op": "compressed", "size_bytes": 4096, "world_size": 4, "time_us": 10.0}]
    (tmp_path / "bw.json").write_text(json.dumps(allreduce_bw))
    for name, what in [("missing.json", "cannot read"), ("text.json", "is not JSON"), ("bw.json", "phases.py")]:
        path = str(tmp_path / name)
        err = _refused(model.main, ["--calibrate", path], capsys)
        assert f"{path}" in err and what in err, err
    phases = str(ROOT / "bench" / "results" / "phases_2h_1gbit.json")
    err = _refused(model.main, ["--calibrate", phases, str(tmp_path / "bw.json")], capsys)
    assert "bw.json" in err and "numel" in err and "allreduce_bw.py" in err, err


def test_cost_model_refuses_a_calibration_on_one_rank_and_labels_small_sizes(tmp_path, capsys):
    """A one-rank phases run (phases.py --nprocs 1) crashed the fit with ZeroDivisionError, and
    a 64 KiB row read "0 MiB" (from a probe)."""
    model = bench_scripts.load("cost_model")
    phases = json.loads((ROOT / "bench" / "results" / "phases_2h_1gbit.json").read_text())
    alone = str(tmp_path / "one.json")
    (tmp_path / "one.json").write_text(json.dumps([{**r, "world_size": 1} for r in phases]))
    assert "needs a run on at least 2 ranks" in _refused(model.main, ["--calibrate", alone], capsys)
    assert model.size_label(64 * 1024) == "64 KiB" and model.size_label(100 * 2**20) == "100 MiB"


def test_cost_model_refuses_zero_cores(capsys):
    model = bench_scripts.load("cost_model")
    phases = str(ROOT / "bench" / "results" / "phases_2h_1gbit.json")
    assert "--cores must be at least 1" in _refused(model.main, ["--calibrate", phases, "--cores", "0"], capsys)


# ------------------------------------------------------------------ netsim.py


@pytest.mark.parametrize(
    "argv, why",
    [
        (["--subnet", "foo"], "argument --subnet: 'foo' is not a private IPv4 network"),
        (["--subnet", "8.8.8.0/24"], "argument --subnet: '8.8.8.0/24' is not a private IPv4 network"),
        (["--tag", "cs42"], "argument --tag: cs42: cs<digits> is reserved"),
    ],
    ids=["subnet-malformed", "subnet-public", "tag-of-the-default-form"],
)
def test_netsim_refuses_as_a_usage_error(argv, why, monkeypatch, capsys):
    netsim = bench_scripts.load("netsim")
    monkeypatch.setattr(netsim, "preflight", _no_ranks)  # nothing is checked or built
    assert why in _refused(netsim.main, [*argv, "--", "true"], capsys)


def test_netsim_picks_only_the_names_of_default_runs_that_are_gone():
    netsim = bench_scripts.load("netsim")
    gone = ["cs123-h0", "cs123-h11", "cs123-r", "cs123br", "cs123v0", "cs123p1"]
    running = ["cs456-h0", "cs456br", "cs456v3"]
    others = ["lo", "eth0", "ifb0", "docker0", "cst4567a-h0", "cs-h0", "cs123", "cs123-h", "xcs123-h0", "cs123-h0x"]
    assert netsim.stale_names([*gone, *running, *others], alive={456}.__contains__) == gone


def test_netsim_sweeps_every_name_of_a_default_cluster_once_its_run_is_gone():
    """Each name a cluster under the default tag makes (without building it) is picked once its
    pid is gone, and none while it runs; this process's pid counts as running."""
    netsim = bench_scripts.load("netsim")
    cluster = netsim.Cluster(3, "1gbit")
    assert cluster.tag == netsim.default_tag(os.getpid())
    peers = [f"{cluster.tag}p{i}" for i in range(3)]
    cgroups = [Path(path).name for path in cluster.cgroups.dirs()]
    made = [*cluster.namespaces, cluster.router, cluster.bridge, *cluster.host_veths, *peers, *cgroups]
    assert netsim.stale_names(made, alive=lambda n: False) == made
    assert netsim.stale_names(made, alive=netsim.live_tags().__contains__) == []


def _netns_skip() -> str | None:
    if sys.platform != "linux" or os.geteuid() != 0:
        return "needs root on Linux (network namespaces)"
    if not Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").exists():
        return "needs the cgroup v1 cpu controller"
    probe = subprocess.run(["ip", "netns", "add", f"cst{os.getpid()}-probe"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"cannot create network namespaces here: {probe.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", f"cst{os.getpid()}-probe"], capture_output=True)
    return None


@pytest.mark.netns
def test_netsim_sweeps_what_a_killed_run_left_behind():
    """A run killed by SIGKILL, staged: its namespace (a rank still running in it), its cgroup,
    bridge and veth pair. The next run removes them all, kills the rank, and says so."""
    why = _netns_skip()
    if why is not None:
        pytest.skip(why)
    netsim = bench_scripts.load("netsim")
    done = subprocess.Popen(["true"])
    done.wait()
    tag = netsim.default_tag(done.pid)  # a run whose pid is gone
    assert done.pid % netsim.TAG_PIDS not in netsim.live_tags(), "the pid came back already"
    ns, cgroup = f"{tag}-h0", Path("/sys/fs/cgroup/cpu") / f"{tag}-h0"
    rank = None
    try:
        for cmd in (["netns", "add", ns], ["link", "add", f"{tag}br", "type", "bridge"]):
            subprocess.run(["ip", *cmd], check=True, capture_output=True)
        subprocess.run(["ip", "link", "add", f"{tag}v0", "type", "veth", "peer", "name", f"{tag}p0"], check=True)
        cgroup.mkdir()
        rank = subprocess.Popen(["ip", "netns", "exec", ns, "sleep", "60"], start_new_session=True)
        proc = subprocess.run(
            [sys.executable, str(ROOT / "bench" / "netsim.py"), "--hosts", "1", "--rate", "none"]
            + ["--tag", f"cst{os.getpid()}s", "--", "true"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 0, proc.stderr
        for what in (
            f"namespace {ns} (and the 1 process(es) still in it)",
            f"cgroup {cgroup}",
            f"link {tag}br",
            f"link {tag}v0",
        ):
            assert what in proc.stderr, proc.stderr
        assert rank.wait(10) == -9
        links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
        namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert tag not in links + namespaces and not cgroup.exists()
    finally:
        if rank is not None and rank.poll() is None:
            rank.kill()
            rank.wait()
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        for link in (f"{tag}br", f"{tag}v0"):
            subprocess.run(["ip", "link", "del", link], capture_output=True)
        if cgroup.exists():
            cgroup.rmdir()

"""Smoke tests of bench/train_step.py: a tiny self-spawned run (default suite) and a run inside
bench/netsim.py (netns marker). They check the records and the byte accounting, not speed."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import bench_scripts

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "train_step.py"
SPEC_KEYS = {"method", "world_size", "step_time_ms", "bytes_per_step", "final_loss", "steps"}
TINY = [
    "--context",
    "4",
    "--embed",
    "4",
    "--hidden",
    "32",
    "--batch",
    "4",
    "--steps",
    "4",
    "--warmup-steps",
    "2",
    "--text-bytes",
    "20000",
    "--sync-every",
    "2",
    "-q",
]
DDP_METHODS = {
    "ddp_adamw",
    "ddp_adamw_bf16",
    "ddp_adamw_powersgd",
    "ddp_sgd",
    "ddp_sgd_onebit",
    "ddp_sgd_onebit_propagate",
}


def check_records(records: list[dict], world: int) -> None:
    by = {r["method"]: r for r in records}
    assert DDP_METHODS | {"onebit_adam", "onebit_lamb", "diloco", "diloco_exact", "diloco_rotate"} <= set(by), sorted(
        by
    )
    for r in records:
        assert SPEC_KEYS <= set(r), SPEC_KEYS - set(r)
        assert r["world_size"] == world and r["steps"] == 4
        assert r["step_time_ms"] > 0 and math.isfinite(r["final_loss"])
    params, ring = by["ddp_adamw"]["params"], 2 * (world - 1) / world
    fp32 = ring * 4 * params
    assert by["ddp_adamw"]["bytes_per_step"] == pytest.approx(fp32)
    assert by["ddp_sgd"]["bytes_per_step"] == pytest.approx(fp32)
    assert by["ddp_adamw_bf16"]["bytes_per_step"] == pytest.approx(fp32 / 2)
    for name in ("ddp_sgd_onebit", "onebit_adam", "onebit_lamb", "ddp_adamw_powersgd"):
        assert by[name]["warmup_bytes_per_step"] == pytest.approx(fp32, rel=0.01), name  # uncompressed
        assert 0 < by[name]["bytes_per_step"] < fp32 / 4, name
    assert 0 <= by["ddp_adamw"]["comm_fraction"] <= 1
    for name in ("onebit_adam", "onebit_lamb"):  # measured by the optimizers' last_comm_timing
        for key in ("comm_hidden_fraction", "warmup_comm_hidden_fraction"):
            assert 0 <= by[name][key] <= 1, (name, key)
    assert all(by[name]["comm_hidden_fraction"] is None for name in DDP_METHODS)
    # DiLoCo syncs every 2 steps: in the last two steps, one 1-bit or one exact sync
    assert 0 < by["diloco"]["bytes_per_step"] < fp32 / 16
    assert by["diloco_exact"]["bytes_per_step"] == pytest.approx(fp32 / 2, rel=0.01)
    assert by["diloco"]["sync_every"] == 2
    assert by["diloco_rotate"]["bytes_per_step"] == by["diloco"]["bytes_per_step"]  # rotation sends nothing more


def test_tiny_run_self_spawned(tmp_path):
    out = tmp_path / "r.json"
    cmd = [sys.executable, str(SCRIPT), "--nprocs", "2", *TINY, "--json", str(out)]
    if _has_matplotlib():
        cmd += ["--plot", str(tmp_path / "r.png")]
    proc = subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "step(ms)" in proc.stdout and "speedup of ddp_sgd_onebit over ddp_sgd" in proc.stdout
    assert "# codec: cpu: " in proc.stdout  # the header names the codec that ran
    assert "diloco mean step / the step with no communication:" in proc.stdout
    check_records(json.loads(out.read_text()), 2)
    if _has_matplotlib():
        assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _run(args: list[str], command: list[str] | None = None, timeout: int = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "RANK", "WORLD_SIZE"))}
    return subprocess.run(
        [*(command or [sys.executable]), str(SCRIPT), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**env, "OMP_NUM_THREADS": "1"},
    )


def test_a_run_no_longer_than_its_warmup_still_reports(tmp_path):
    """--steps at most --warmup-steps: every step is reported as the (only) stage, and the JSON
    is written (it raised an IndexError after training)."""
    out = tmp_path / "r.json"
    proc = _run(
        ["--nprocs", "2", *TINY, "--steps", "3", "--warmup-steps", "4", "--methods", "ddp_sgd", "--json", str(out)]
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (record,) = json.loads(out.read_text())
    assert record["steps"] == 3 and record["step_time_ms"] > 0 and len(record["step_times_ms"]) == 3


@pytest.mark.parametrize(
    "args, says",
    [
        (["--methods", "ddp_sgd,onebit_adam", "--warmup-steps", "0"], "--warmup-steps >= 1"),
        (["--methods", "ddp_adamw_powersgd", "--warmup-steps", "1"], "--warmup-steps >= 2"),
        (["--methods", "diloco", "--sync-every", "0"], "--sync-every and --diloco-fragments must be >= 1"),
        (["--methods", "ddp_sgd", "--backend", "mpi"], "--backend mpi runs under mpirun"),
        (
            ["--methods", "ddp_sgd,diloco", "--sync-every", "2", "--diloco-fragments", "3"],
            "must be at most --sync-every",
        ),
        (["--methods", "diloco", "--sync-every", "4", "--diloco-fragments", "4", "--bucket-mb", "1"], "make 1"),
        (["--methods", "ddp_sgd,diloco_exact", "--steps", "6", "--sync-every", "8"], "times no sync"),
    ],
)
def test_arguments_a_method_cannot_take_are_refused_before_any_rank_starts(args, says, monkeypatch, capsys):
    """Refused by the parser with the reason (they used to fail on a rank after the methods
    before them had trained, in a traceback; DiLoCo's fragments, and a run too short for a
    DiLoCo sync, which reported a step time "with its syncs" that had none: from a probe)."""
    status, err = bench_scripts.refusal("train_step", ["--nprocs", "2", *TINY, *args], monkeypatch, capsys)
    assert status == 2 and says in err, err[-2000:]


@pytest.mark.mpi
def test_under_mpirun_the_ranks_mpirun_started_are_the_world(tmp_path):
    """mpirun -n 2 python bench/train_step.py: the two processes form one gloo group (torch's
    methods) and compcomm's collectives run on --backend mpi; neither spawns ranks of its own
    (--nprocs is for plain runs), and one JSON is written by rank 0."""
    from compcomm.launch import find_mpirun

    mpirun = find_mpirun()
    if mpirun is None:
        pytest.skip("no mpirun")
    pytest.importorskip("mpi4py")
    out = tmp_path / "r.json"
    methods = "ddp_sgd,ddp_sgd_onebit,onebit_adam,diloco"
    command = [mpirun, "--allow-run-as-root", "--oversubscribe", "-n", "2", sys.executable]
    proc = _run(["--nprocs", "3", *TINY, "--methods", methods, "--backend", "mpi", "--json", str(out)], command, 240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("# compcomm train_step: mpirun, world size 2, torch on gloo, compcomm on mpi") == 1
    records = json.loads(out.read_text())
    assert [r["method"] for r in records] == methods.split(",") and {r["world_size"] for r in records} == {2}
    fp32 = 4 * records[0]["params"]  # 2(n-1)/n = 1 on two ranks
    assert records[0]["bytes_per_step"] == pytest.approx(fp32)
    assert 0 < records[1]["bytes_per_step"] < fp32 / 16 and 0 < records[2]["bytes_per_step"] < fp32 / 16


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _netns_skip() -> str | None:
    if sys.platform != "linux" or os.geteuid() != 0:
        return "needs Linux and root (network namespaces)"
    if any(shutil.which(t) is None for t in ("ip", "tc")):
        return "needs iproute2 (ip, tc)"
    return None


@pytest.mark.netns
@pytest.mark.skipif(_netns_skip() is not None, reason=_netns_skip() or "")
def test_tiny_run_inside_netsim(tmp_path):
    out = tmp_path / "r.json"
    cmd = [
        sys.executable,
        str(ROOT / "bench" / "netsim.py"),
        "--hosts",
        "2",
        "--rate",
        "1gbit",
        "--subnet",
        "10.77.11.0/24",
        "--tag",
        f"cstt{os.getpid() % 10000}",
        "--threads",
        "1",
        "--",
        sys.executable,
        str(SCRIPT),
        *TINY,
        "--json",
        str(out),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "netsim 1gbit" in proc.stdout
    check_records(json.loads(out.read_text()), 2)

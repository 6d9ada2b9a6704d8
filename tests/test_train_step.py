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
    assert "diloco mean step / the step with no communication:" in proc.stdout
    check_records(json.loads(out.read_text()), 2)
    if _has_matplotlib():
        assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


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

"""bench/convergence.py: its settings for ZeroOneAdam (the local-step interval follows the learning rate),
and a tiny run end to end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import bench_scripts

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "convergence.py"


def _load_module():
    return bench_scripts.load("convergence")


def intervals(args) -> list[tuple[int, int]]:
    """(step, local-step interval H) over the compression stage, by ZeroOneAdam's rule: H doubles
    every local_step_scaler steps after var_freeze_step, up to local_step_clipper."""
    cv = _load_module()
    freeze, h, out = cv.freeze_step(args), 1, []
    for t in range(freeze + 1, args.steps + 1):
        out.append((t, h))
        if (t - freeze) % args.local_step_scaler == 0:
            h = min(2 * h, args.local_step_clipper)
    return out


def test_local_steps_lengthen_as_the_learning_rate_decays():
    cv = _load_module()
    args = cv.parse_args([])
    start = cv.lr_factor(args, cv.freeze_step(args))
    seen = intervals(args)
    # the interval grows over the run (to 8 at the end of the default cosine schedule) ...
    assert max(h for _, h in seen) == 8
    # ... but a rank never walks alone much farther than one step at the rate of the freeze
    assert max(h * cv.lr_factor(args, t) for t, h in seen) <= 1.5 * start


def test_a_constant_learning_rate_keeps_syncing_every_step():
    cv = _load_module()
    args = cv.parse_args(["--schedule", "constant"])
    assert {h for _, h in intervals(args)} == {1}


def test_an_explicit_scaler_is_kept():
    cv = _load_module()
    assert cv.parse_args(["--local-step-scaler", "40"]).local_step_scaler == 40


def test_a_diverged_run_is_said_and_the_expected_reduction_follows_the_warmup_as_run(capsys):
    """--steps 4 runs a warm-up of one step, not 0.15 x 4: the expected byte reduction said 5.66x
    beside the 3.66x the run had, and a 1-bit run that diverged there (a nan final loss) went
    by with its nan gap and no word (from a probe)."""
    cv = _load_module()
    runs = [("adam", 3.0, 3200), ("onebit_adam", float("nan"), 875)]
    results = [{"name": name, "final_val_loss": loss, "bytes_sent": sent} for name, loss, sent in runs]
    report = cv.summarize(results, cv.parse_args(["--steps", "4"]), 2)
    assert report["diverged"] == ["onebit_adam"]
    assert abs(report["summary"]["expected_onebit_reduction_at_warmup"] - 1 / (0.25 + 0.75 / 32)) < 1e-12
    cv.print_report(report)
    assert "WARNING: onebit_adam diverged" in capsys.readouterr().out


def test_diloco_takes_adams_learning_rate_unless_given_its_own():
    cv = _load_module()
    assert cv.diloco_inner_lr(cv.parse_args(["--lr-adam", "6e-3"])) == 6e-3
    assert cv.diloco_inner_lr(cv.parse_args(["--lr-adam", "6e-3", "--lr-diloco", "8e-3"])) == 8e-3


def test_tiny_run_writes_every_run_and_its_bytes(tmp_path):
    """bench/convergence.py end to end on 2 self-spawned ranks: every run reported, the
    compressed one sending fewer bytes than its baseline."""
    tiny = ["--task", "transformer", "--hidden", "16", "--context", "8", "--batch", "4", "--steps", "12"]
    tiny += ["--eval-every", "6", "--val-windows", "64", "--world-size", "2", "--text-bytes", "50000"]
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *tiny, "--runs", "lamb,onebit_lamb", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "convergence_transformer.json").read_text())
    runs = {r["name"]: r for r in report["runs"]}
    assert set(runs) == {"lamb", "onebit_lamb"} and report["world_size"] == 2
    assert [c["step"] for c in runs["onebit_lamb"]["curve"]] == [6, 12]
    assert 0 < runs["onebit_lamb"]["bytes_sent"] < runs["lamb"]["bytes_sent"]
    assert "onebit_lamb_vs_lamb_gap_pct" in report["summary"]

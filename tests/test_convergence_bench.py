"""bench/convergence.py's settings for ZeroOneAdam: the local-step interval follows the learning rate."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "convergence.py"


def _load_module():
    spec = importlib.util.spec_from_file_location("convergence_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


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

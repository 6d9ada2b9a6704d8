"""Test programs started as whole launches (mpirun, or a program that spawns its own ranks),
each rank writing its results to `<out>/<prefix>rank<r>.json` for the tests to assert on."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path

import pytest

from compcomm.launch import mpirun

ROOT = Path(__file__).resolve().parents[2]


def mpirun_python(nprocs: int) -> list[str]:
    """`mpirun ... -n nprocs <this python>`, or skip the test when mpi4py or mpirun is missing."""
    if importlib.util.find_spec("mpi4py") is None:
        pytest.skip("mpi4py is not installed (pip install compcomm[mpi])")
    try:
        return mpirun(nprocs)
    except RuntimeError as exc:
        pytest.skip(str(exc))


def launch(cmd: list[str], out: Path, prefix: str, world: int, timeout_s: float) -> list[dict]:
    """Run `cmd` to completion and return every rank's results; fail the test on a hang or error."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{cmd[0]} did not finish within {timeout_s}s (hang?): {exc.stderr!r:.2000}")
    files = [out / f"{prefix}rank{r}.json" for r in range(world)]
    missing = [f.name for f in files if not f.exists()]
    if done.returncode != 0 or missing:
        pytest.fail(
            f"{' '.join(cmd)} exited {done.returncode} (missing results: {missing})\n"
            f"stdout: {done.stdout[-3000:]}\nstderr: {done.stderr[-3000:]}"
        )
    return [json.loads(f.read_text()) for f in files]


def passed(ranks: list[dict], check: str) -> list[dict]:
    """The per-rank results of one check, after asserting that it passed on every rank."""
    results = [r[check] for r in ranks]
    failures = [f"rank {i}: {res['detail']}" for i, res in enumerate(results) if not res["ok"]]
    assert not failures, "\n".join(failures)
    return results

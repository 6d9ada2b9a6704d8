"""compcomm.launch: the one way tests and benchmarks start local ranks."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

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


def gloo_work_then_exit() -> int:
    """The exit that aborted bench/train_step.py now and then: a DDP model (which keeps torch's
    default group alive past destroy_process_group), gloo collectives whose tensors Python has
    dropped, and an exit right after them. The long switch interval keeps the GIL from gloo's
    worker threads until the process exits, unless something releases it."""
    import torch
    import torch.distributed as dist

    sys.setswitchinterval(100.0)
    with launch.process_group("gloo"):
        torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
        for work in [dist.all_reduce(torch.ones(4096), async_op=True) for _ in range(8)]:
            work.wait()
        return dist.get_rank()


def groups_made_again(folder: str) -> list[tuple[int, int]]:
    """Three times: a default group (a file store), a compressed call over it, then
    destroy_process_group; a fourth time through launch.process_group. After each, compcomm's
    channels and this process's open file descriptors."""
    import torch
    import torch.distributed as dist

    import compcomm
    from compcomm.backends import ordering

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    ef = compcomm.ErrorFeedback()
    counts = []
    for cycle in range(4):
        store = f"file://{folder}/store{cycle}"
        with contextlib.ExitStack() as stack:
            if cycle < 3:
                dist.init_process_group("gloo", init_method=store, rank=rank, world_size=world)
                stack.callback(dist.destroy_process_group)
            else:
                stack.enter_context(launch.process_group("gloo", init_method=store, rank=rank, world_size=world))
            compcomm.compressed_allreduce(torch.ones(1000), ef)
        counts.append((len(ordering._registry), len(os.listdir("/proc/self/fd"))))
    return counts


def test_a_default_group_made_again_leaves_no_transport_behind(tmp_path):
    """compcomm's private transports were kept for the life of the process: each default group
    destroyed and made again left its sockets open (about 10 descriptors a time here). A new
    group's first call now closes those of destroyed ones, and launch.process_group at its exit."""
    for counts in launch.spawn(groups_made_again, 2, str(tmp_path)):
        assert [channels for channels, _ in counts] == [1, 1, 1, 0], counts
        assert counts[1][1] == counts[2][1] and counts[3][1] < counts[2][1], counts


def broken_channel_made_again(folder: str) -> tuple[int, int, int]:
    """A shm channel broken by a timeout (rank 1 stays away from two calls of rank 0's, the second
    refused while it waits), then a default group made again and a call in it: compcomm's
    channels before and after that call, and the failures it still keeps by an old group's key."""
    import torch
    import torch.distributed as dist

    import compcomm
    from compcomm.backends import ordering
    from compcomm.backends.shm import ShmBackend
    from compcomm.backends.torch_dist import made_before_this_world

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=f"file://{folder}/s0", rank=rank, world_size=world)
    shm = ShmBackend(timeout=1.0)
    shm.barrier()
    if rank == 0:
        calls = [shm.all_reduce(torch.ones(10), async_op=True) for _ in range(2)]
        for call in calls:
            with contextlib.suppress(RuntimeError):
                call.wait()
    dist.barrier()
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"file://{folder}/s1", rank=rank, world_size=world)
    before = len(ordering._registry)
    compcomm.compressed_allreduce(torch.ones(1000), compcomm.ErrorFeedback())
    after = len(ordering._registry)
    kept = sum(made_before_this_world(key) for key in ordering._broken)
    dist.destroy_process_group()
    return before, after, kept


def test_a_broken_channel_goes_with_its_group(tmp_path):
    """A call refused while it waited behind a timed-out one never counted as served, so its
    broken channel was never idle and never closed; and its failure, kept by its key, kept the
    destroyed default group alive (its sockets and threads)."""
    assert launch.spawn(broken_channel_made_again, 2, str(tmp_path)) == [(1, 1, 0), (1, 1, 0)]


def world_made_again_alone(folder: str) -> tuple[float, int, int, float]:
    """A call in a world of two, then each rank alone in a world of one made after it: the first
    call's result, the default backend's rank and size in the new world, and its call's result."""
    import torch
    import torch.distributed as dist

    import compcomm
    from compcomm.backends import resolve

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=f"file://{folder}/both", rank=rank, world_size=world)
    pair = compcomm.compressed_allreduce(torch.full((1000,), float(rank + 1)), compcomm.ErrorFeedback())
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"file://{folder}/alone{rank}", rank=0, world_size=1)
    alone = compcomm.compressed_allreduce(torch.full((1000,), float(rank + 1)), compcomm.ErrorFeedback())
    be = resolve(None)
    seen = be.rank, be.world_size
    dist.destroy_process_group()
    return pair[0].item(), *seen, alone[0].item()


def test_the_default_backend_follows_a_default_group_made_again_with_other_ranks(tmp_path):
    """The default backend is kept across default groups, and reads its group's rank and size
    once per default group (a call asks a dozen times): a group made again with another size
    and rank must be read anew, or the call would run over the old world's ranks."""
    assert launch.spawn(world_made_again_alone, 2, str(tmp_path), timeout=120) == [
        (1.5, 0, 1, 1.0),
        (1.5, 0, 1, 2.0),
    ]


def backends_of_a_destroyed_group(folder: str) -> dict | None:
    """Three ranks use shm by name, an shm backend and a gloo one over a sub-group; then ranks 0
    and 1 make a default group of two: what each of those does there, and a new shm backend."""
    import torch
    import torch.distributed as dist

    import compcomm
    from compcomm.backends import get

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])

    def outcome(backend: object) -> object:
        try:
            return compcomm.compressed_allreduce(torch.full((64,), float(rank)), compcomm.ErrorFeedback(), backend)[
                0
            ].item()
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"

    dist.init_process_group("gloo", init_method=f"file://{folder}/three", rank=rank, world_size=world)
    sub = dist.new_group([0, 1])
    old_shm, old_sub = get("shm"), get("gloo", group=sub) if rank < 2 else None
    before = [outcome("shm"), outcome(old_shm), outcome(old_sub) if old_sub else None]
    dist.destroy_process_group()
    if rank == 2:
        return None
    dist.init_process_group("gloo", init_method=f"file://{folder}/two", rank=rank, world_size=2)
    after = {"by name": outcome("shm"), "old shm": outcome(old_shm), "old sub-group": outcome(old_sub)}
    after["new shm"] = outcome(get("shm"))
    old_shm.close()
    dist.destroy_process_group()
    return {"before": before, **after}


def test_backends_of_a_destroyed_default_group_are_refused_and_names_follow_the_new_one(tmp_path):
    """After the default group was made again with fewer ranks, backend="shm" by name still took
    the shm backend built for the three ranks (its rank and size fixed then): the call waited for
    a rank that had gone, then broke the new group's shm lane, so a new shm backend over the new
    group was refused too; a gloo backend over an old sub-group raised torch's KeyError (from a
    probe). Names now give a backend of the present group; an old shm backend, or one over an old
    sub-group, is refused with a RuntimeError that says why, and leaves the new group alone."""
    results = launch.spawn(backends_of_a_destroyed_group, 3, str(tmp_path), timeout=120)
    assert results[2] is None
    for res in results[:2]:
        assert res["before"][:2] == [1.0, 1.0] and res["before"][2] == 0.5, res
        assert res["by name"] == 0.5 and res["new shm"] == 0.5, res
        for old in ("old shm", "old sub-group"):
            assert res[old].startswith("RuntimeError") and "destroyed" in res[old], res


def test_ranks_leaving_process_group_exit_cleanly():
    """launch.process_group lets gloo's workers release their last collectives before the
    process exits (before it, about one run in four of these four ranks died of SIGABRT in
    ProcessGroupGloo::runLoop), and spawn reports a rank that crashes as it exits."""
    for _ in range(4):
        assert launch.spawn(gloo_work_then_exit, 4, timeout=120) == [0, 1, 2, 3]


def crash_after_returning() -> None:
    import atexit

    atexit.register(os.abort)


def test_a_rank_crashing_after_its_result_raises():
    with pytest.raises(RuntimeError, match=r"rank\(s\) \[0, 1\] returned a result but then exited with codes"):
        launch.spawn(crash_after_returning, 2)


@pytest.mark.parametrize(
    ("world_size", "timeout", "error", "match"),
    [
        (1.5, None, TypeError, "world_size must be an integer, got float 1.5"),
        (0, None, ValueError, "world_size must be >= 1, got 0"),
        (2, 0, ValueError, "timeout must be a number of seconds > 0 or None, got 0"),
        (2, -1.0, ValueError, "got -1.0"),
        (2, float("nan"), ValueError, "got nan"),
        (2, "60", ValueError, "got '60'"),
    ],
)
def test_spawn_refuses_bad_arguments_before_starting_a_rank(world_size, timeout, error, match):
    with pytest.raises(error, match=re.escape(match)):
        launch.spawn(environment, world_size, "x", timeout=timeout)


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


def _spawned_ranks(parent: int) -> list[int]:
    """The pids of the ranks `parent` spawned (its children running multiprocessing's spawn)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        if int(stat.rpartition(")")[2].split()[1]) == parent and b"spawn_main" in cmdline:
            found.append(int(entry.name))
    return found


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_ranks_end_when_the_spawning_process_is_killed():
    """A SIGTERM to the process running spawn() left its ranks running to the end of their work
    (a benchmark's ranks went on printing its table and writing its files)."""
    code = "import time, compcomm\ncompcomm.launch.spawn(time.sleep, 2, 120)\n"
    parent = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 60
        while len(ranks := _spawned_ranks(parent.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(ranks) == 2, "the ranks did not start"
        parent.send_signal(signal.SIGTERM)
        parent.wait(timeout=30)
        deadline = time.monotonic() + 10
        while any(_running(pid) for pid in ranks) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_running(pid) for pid in ranks)
    finally:
        parent.kill()
        for pid in _spawned_ranks(parent.pid) + locals().get("ranks", []):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

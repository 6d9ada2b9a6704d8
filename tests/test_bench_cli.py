"""The command lines of bench/train_step.py, allreduce_bw.py, timeline.py and phases.py (probe
findings): arguments that cannot give a truthful table are refused before any rank starts, and
what the tables and summaries print says what was measured.

Most checks call a program's `main` in this process with `compcomm.launch.spawn` replaced by a
failure, so that a refusal is seen to come before any rank is spawned, in milliseconds; two runs
start real ranks (phases.py plainly and under mpirun), since it ran under torchrun only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import compcomm

import bench_scripts

ROOT = Path(__file__).resolve().parents[1]
LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _unlaunched_environment() -> dict[str, str]:
    """This environment without an MPI or torchrun launch's variables: a bench program started
    from here spawns its own ranks (or mpirun starts fresh ones)."""
    return {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("OMPI_", "PMIX_", "PMI_", "MPI_")) and k not in LAUNCH_VARIABLES
    }


@pytest.fixture
def plain(monkeypatch):
    """A plain run's environment in this process, where spawning ranks fails the test."""
    from compcomm import launch

    for name in set(os.environ) - set(_unlaunched_environment()):
        monkeypatch.delenv(name)
    assert launch.launcher() is None

    def spawn(*args, **kwargs):
        raise AssertionError("ranks were spawned: the arguments were not refused first")

    monkeypatch.setattr(launch, "spawn", spawn)


def refusal(main: Callable[[list[str]], int], argv: list[str], capsys) -> str:
    """What `main(argv)` says as it exits without running: argparse's error, or SystemExit's."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    code = exc.value.code
    assert code not in (0, None), f"exited with {code!r}"
    return capsys.readouterr().err + (code if isinstance(code, str) else "")


# ---------------------------------------------------------------------------------------------
# train_step.py

TINY_MODEL = ["--context", "4", "--embed", "4", "--hidden", "8", "--batch", "2", "-q"]


@pytest.mark.parametrize(
    "args, says",
    [
        (["--nprocs", "0"], "--nprocs must be at least 1, got 0"),
        (["--methods", ","], "--methods names no method"),
        (["--lr-adam", "0"], "--lr-adam must be a positive number, got 0"),
        (["--lr-sgd", "-0.1"], "--lr-sgd must be a positive number, got -0.1"),
        (["--lr-lamb", "nan"], "--lr-lamb must be a positive number, got nan"),
        (["--batch", "0"], "--batch must be >= 1, got 0"),
        (["--text-bytes", "5"], "--text-bytes must be at least the context + 2 (6), got 5"),
        (["--bucket-mb", "-1"], "--bucket-mb must be a positive number, got -1"),
        (["--nprocs", "1", "--methods", "hsdp_adamw"], "hsdp_adamw need at least 2 ranks"),
    ],
)
def test_train_step_refuses_before_spawning(plain, capsys, args, says):
    ts = bench_scripts.load("train_step")
    assert says in refusal(ts.main, ["--nprocs", "2", *TINY_MODEL, "--methods", "ddp_sgd,onebit_adam", *args], capsys)


def test_train_step_skips_hsdp_in_a_world_of_one_and_prints_no_median_ratio_for_diloco(capsys):
    """HSDP in a world of one crashed the run (its hosts were world // 0); DiLoCo's median step
    is one without a sync, so its ratio of medians to DDP's overstated it (its mean step with
    the syncs is reported on a line of its own)."""
    ts = bench_scripts.load("train_step")
    assert "at least 2 ranks" in ts.skipped_because("hsdp_adamw", 1)
    assert ts.skipped_because("hsdp_adamw", 2) is None and ts.skipped_because("fsdp_adamw", 1) is None
    row = {"step_time_ms": 10.0, "mean_step_time_ms": 50.0, "sync_every": 8}
    lines = ts.ratios({"ddp_adamw": {"step_time_ms": 100.0, "mean_step_time_ms": 100.0}, "diloco": row})
    assert not any(line.startswith("speedup of diloco") for line in lines)
    assert "diloco mean step with its syncs (every 8 steps): 50.0 ms, 2.00x faster than ddp_adamw's mean step" in lines


def test_train_step_within_the_warmup_reports_no_compression_stage(monkeypatch, capsys):
    """--steps <= --warmup-steps (the warm-up alone, as bench/results/train_step_warmup_netsim_4h
    measures it): a staged method has no compression-stage step time, bytes or speedup (they
    were its warm-up steps, labelled as the compression stage); its warm-up columns and the
    methods without a stage report as before."""
    ts = bench_scripts.load("train_step")
    args = ts.parse_args([*TINY_MODEL, "--steps", "3", "--warmup-steps", "4", "--methods", "ddp_adamw,onebit_adam"])
    res = {"times": [0.3, 0.1, 0.2], "losses": [3.0, 2.0, 1.0], "sent": [1e3, 2e3, 3e3], "comm": [None] * 3}
    written: list[dict] = []
    monkeypatch.setattr(ts, "write_json", lambda records, path: written.extend(records))
    args.json = "r.json"
    ts.report({"ddp_adamw": res, "onebit_adam": res}, args, 2, "test")
    base, onebit = written
    assert onebit["step_time_ms"] is None and onebit["bytes_per_step"] is None
    assert onebit["mean_step_time_ms"] is None and onebit["comm_hidden_fraction"] is None
    assert onebit["warmup_step_time_ms"] == pytest.approx(150.0) and onebit["warmup_bytes_per_step"] == 1e3
    assert base["step_time_ms"] == pytest.approx(200.0) and base["bytes_per_step"] == 1e3  # no stage: every step
    out = capsys.readouterr().out
    assert "3 steps (all in the warm-up: no compression stage for onebit_adam)" in out
    (row,) = [line.split() for line in out.splitlines() if line.startswith("  onebit_adam")]
    assert row[1:5] == ["-", "150.0", "-", "1000"]
    assert "speedup of onebit_adam" not in out and "onebit_adam warm-up step: 0.75x ddp_adamw's step" in out


# ---------------------------------------------------------------------------------------------
# allreduce_bw.py


@pytest.mark.parametrize(
    "args, says",
    [
        (["--link-rate", "foo"], "argument --link-rate: bad rate 'foo'"),
        (["--link-rate", "0gbit"], "argument --link-rate: rate must be positive"),
        (["--intra", "shm"], "--intra is the transport inside a node of --hierarchical"),
        (["-b", "3", "-e", "3"], "--max-bytes 3 is less than one element (4 bytes)"),
        (["-b", "1", "-e", "1", "-d", "bf16"], "--max-bytes 1 is less than one element (2 bytes)"),
        pytest.param(
            ["--hierarchical", "--intra", "nccl"],
            "--intra nccl needs CUDA GPUs",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA"),
        ),
    ],
)
def test_allreduce_bw_refuses_before_spawning(plain, capsys, args, says):
    """--link-rate was read after the whole sweep (a traceback, and no --json); --intra alone was
    ignored; -b 3 -e 3 timed a 4-byte row."""
    bw = bench_scripts.load("allreduce_bw")
    assert says in refusal(bw.main, ["--nprocs", "2", "-b", "4K", "-e", "4K", "-n", "1", "-q", *args], capsys)


def test_allreduce_bw_records_one_name_per_dtype_and_the_untimed_calls_that_ran(monkeypatch):
    """-d bf16 and -d bfloat16 wrote different dtypes into the records; -w 0 recorded no warm-up
    although the first call (which measures the error) always runs untimed."""
    bw = bench_scripts.load("allreduce_bw")
    for alias, name in (("bf16", "bfloat16"), ("float", "float32"), ("half", "float16")):
        args = bw.build_parser().parse_args(["-d", alias])
        bw.check_args(args)
        assert args.dtype == name
    args = bw.build_parser().parse_args(["-w", "0", "-n", "1"])
    bw.check_args(args)
    be = compcomm.backends.get("local")
    x = torch.randn(64)
    assert bw.measure("compressed", be, x, x.clone(), args, 256)["warmup"] == 1


def test_allreduce_bw_header_says_the_untimed_calls_that_run(capsys):
    """With -w 0 the header said "warmup 0" while the records said 1 (the call that measures
    the error always runs)."""
    bw = bench_scripts.load("allreduce_bw")
    args = bw.build_parser().parse_args(["-w", "0"])
    bw.check_args(args)
    bw.print_header(args, 2, "test")
    assert "warmup 1," in capsys.readouterr().out


def test_allreduce_bw_refuses_a_size_no_host_could_hold_before_any_rank_starts():
    """-e 1000G started 4 ranks, ran the smaller sizes and failed on every rank with the
    allocator's error; it is a usage error at once now."""
    bw = bench_scripts.load("allreduce_bw")
    with pytest.raises(SystemExit, match="needs at least .* of memory on this host"):
        bw.main(["-b", "1000G", "-e", "1000G"])
    assert bw.memory_problem(2**30, 4, 4, 64 * 2**30) is None
    assert "needs at least 32 GiB" in bw.memory_problem(2**30, 2, 4, 16 * 2**30)  # bf16: 2 + 3 x 2 copies


def test_the_mpi_hint_under_a_launcher_names_the_ranks_it_started(monkeypatch):
    """--backend mpi under torchrun printed an mpirun line for --nprocs' default (4), not for
    the ranks torchrun had started."""
    ranks = bench_scripts.load("ranks")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    why = ranks.mpirun_needed(4)
    assert why is not None and " -n 3 " in why, why


def test_allreduce_bw_rows_stay_within_the_sizes_asked_for():
    bw = bench_scripts.load("allreduce_bw")
    assert bw.sweep_sizes(1, 8, 2, 4) == [4, 8]
    with pytest.raises(ValueError, match="less than one element"):
        bw.sweep_sizes(3, 3, 2, 4)


def _row(op: str, size: int, busbw: float, backend: str = "gloo", wire: int = 100) -> dict:
    return {"op": op, "size_bytes": size, "busbw_GBps": busbw, "backend": backend, "wire_bytes": wire, "time_us": 10.0}


def test_allreduce_bw_averages_the_flat_rows_and_the_hierarchical_ones_apart(capsys):
    bw = bench_scripts.load("allreduce_bw")
    records = [
        _row("compressed", 1024, 1.0),
        _row("allreduce", 1024, 2.0),
        _row("compressed", 1024, 10.0, "hierarchical"),
        _row("compressed", 4096, 3.0),
        _row("allreduce", 4096, 2.0),
        _row("compressed", 4096, 30.0, "hierarchical"),
    ]
    bw._summary(records)
    averages = {
        line.rsplit("(", 1)[1].rstrip(")"): float(line.split(":")[1].split()[0])
        for line in capsys.readouterr().out.splitlines()
        if line.startswith("# Avg bus bandwidth")
    }
    assert averages == {"compressed": 2.0, "allreduce": 2.0, "hier": 20.0}


def test_allreduce_bw_on_one_rank_says_nothing_was_sent(capsys):
    bw = bench_scripts.load("allreduce_bw")
    bw._summary([_row("compressed", 1024, 0.0, wire=0), _row("allreduce", 1024, 0.0, wire=0)])
    out = capsys.readouterr().out
    assert "no wire bytes" in out and "inf" not in out


def test_allreduce_bw_names_the_variable_that_lets_peak_memory_be_measured(monkeypatch, capsys):
    bw = bench_scripts.load("allreduce_bw")
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    bw.print_header(bw.build_parser().parse_args([]), 2, "test")
    (hint,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("# peak(x)")]
    assert "start the ranks with MALLOC_MMAP_THRESHOLD_=65536 to measure it" in hint and "{" not in hint


# ---------------------------------------------------------------------------------------------
# timeline.py


def test_timeline_reports_and_charts_one_median_call():
    """Of an even number of calls, the median printed is the time of the call reported and
    drawn (the lower of the two middle ones); it printed their mean beside the upper one."""
    timeline = bench_scripts.load("timeline")

    def call(kind: str, index: int, time_ms: float) -> dict:
        ranks = [{"rank": 0, "host": 0, "cpu_ms": time_ms, "spans": [["call", 0.0, time_ms]]}]
        return {"kind": kind, "call": index, "time_ms": time_ms, "ranks": ranks, "links": []}

    calls = [call("flat", i, t) for i, t in enumerate([40.0, 10.0, 30.0, 20.0])]
    meta = {"size_bytes": 4096, "world_size": 1, "ranks_per_host": 1, "hosts": 1, "launch": "test", "rate": ""}
    meta.update(cpus_per_host=None, emulated=False, dilation=1.0)
    lines = timeline.report(calls, meta)
    assert "== flat: calls 40.0, 10.0, 30.0, 20.0 ms; median 20.0 ms, the lower of the two middle calls" in lines
    assert "median call (call 3, 20.0 ms), ms: step, busy, first start - last end" in lines
    assert timeline.by_time(calls, "flat")[1]["call"] == 3
    odd = timeline.report(calls[:3], meta)
    assert "== flat: calls 40.0, 10.0, 30.0 ms; median 30.0 ms" in odd and "median call (call 2, 30.0 ms)" in "\n".join(
        odd
    )


@pytest.mark.parametrize(
    "args, says",
    [
        (["--nprocs", "3"], "3 self-spawned ranks do not split into hosts of 2, the default --ranks-per-host"),
        (["--nprocs", "1"], "or --ranks-per-host 1 (the flat call alone)"),
        (["--nprocs", "4", "--ranks-per-host", "3"], "--ranks-per-host 3 must divide the 4 ranks"),
        (["--nprocs", "0"], "--nprocs must be at least 1, got 0"),
    ],
)
def test_timeline_says_what_to_give_for_an_odd_number_of_ranks(plain, capsys, args, says):
    """It said "--ranks-per-host must divide the 3 ranks" to a user who had not given that flag."""
    timeline = bench_scripts.load("timeline")
    message = refusal(timeline.main, ["--size", "4K", "--calls", "1", *args], capsys)
    assert says in message, message


# ---------------------------------------------------------------------------------------------
# phases.py

PHASES = ROOT / "bench" / "phases.py"


@pytest.mark.parametrize(
    "args, says",
    [
        (["--sizes", "foo"], "argument --sizes: bad size 'foo'"),
        (["--sizes", "0"], "argument --sizes: 0 bytes is less than one fp32 element (4 bytes)"),
        (["--sizes", "1M,3"], "argument --sizes: 3 bytes is less than one fp32 element"),
        (["--sizes", ","], "argument --sizes: ',' names no size"),
        (["--iters", "0"], "--iters must be >= 1, got 0"),
        (["--parts", ","], "--parts names no part"),
        (["--parts", "scan,bogus"], "unknown parts ['bogus']"),
        (["--nprocs", "0"], "--nprocs must be at least 1, got 0"),
        (["--nprocs", "1", "--parts", "rs"], "rs, share, hier time the hierarchical call"),
    ],
)
def test_phases_refuses_before_spawning(plain, capsys, args, says):
    """--sizes was read on every rank (a traceback each), --iters 0 printed nan rows, a size
    under one element timed a row of 4 bytes under another label."""
    phases = bench_scripts.load("phases")
    message = refusal(phases.main, ["--nprocs", "2", *args], capsys)
    assert says in message, message


def _phases(command: list[str], out: Path, nprocs: int) -> subprocess.CompletedProcess:
    args = ["--sizes", "64K,6", "--iters", "1", "--parts", "header,call", "--nprocs", str(nprocs), "--json", str(out)]
    return subprocess.run(
        [*command, str(PHASES), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**_unlaunched_environment(), "OMP_NUM_THREADS": "1"},
    )


def _check_phases(proc: subprocess.CompletedProcess, out: Path, world: int) -> None:
    """One table by rank 0 whose rows name the sizes timed (6 bytes: one fp32 element), with the
    node parts (all ranks on one host), and its records."""
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("n ")]
    assert [row.split("|")[0].split() for row in rows] == [
        ["n", str(world), "size", "65536"],
        ["n", str(world), "size", "4"],
    ]
    assert all("header" in row and "call" in row and "hier" in row for row in rows)
    records = json.loads(out.read_text())
    assert [(r["world_size"], r["size_bytes"], r["ranks_per_host"]) for r in records] == [
        (world, 65536, world),
        (world, 4, world),
    ]


def test_phases_runs_plainly_on_ranks_it_spawns(tmp_path):
    out = tmp_path / "p.json"
    _check_phases(_phases([sys.executable], out, 2), out, 2)


@pytest.mark.mpi
def test_phases_runs_under_mpirun(tmp_path):
    """mpirun -n 2 python bench/phases.py: mpirun's two processes are the gloo group (--nprocs is
    for plain runs)."""
    from compcomm.launch import find_mpirun

    mpirun = find_mpirun()
    if mpirun is None:
        pytest.skip("no mpirun")
    pytest.importorskip("mpi4py")
    out = tmp_path / "p.json"
    command = [mpirun, "--allow-run-as-root", "--oversubscribe", "-n", "2", sys.executable]
    _check_phases(_phases(command, out, 3), out, 2)

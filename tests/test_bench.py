"""Smoke test of bench/allreduce_bw.py: a tiny self-spawned sweep, its JSON checked against SPEC 7."""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import bench_scripts
from fsdp_models import NEEDS_FSDP_SEAMS

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "allreduce_bw.py"
SPEC_KEYS = {
    "op",
    "size_bytes",
    "count",
    "dtype",
    "world_size",
    "backend",
    "time_us",
    "algbw_GBps",
    "busbw_GBps",
    "wire_bytes",
    "rel_error",
}
WORLD = 4


def _unlaunched_environment() -> dict[str, str]:
    """This environment without the variables of an MPI or torchrun launch, so that a bench
    program started from the tests spawns its own ranks (or mpirun starts fresh ones)."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "RANK", "WORLD_SIZE"))}


def _load_module():
    return bench_scripts.load("allreduce_bw")


def test_size_parsing_and_sweep():
    bw = _load_module()
    assert bw.parse_size("1M") == 1 << 20 and bw.parse_size("64K") == 65536 and bw.parse_size("4096") == 4096
    assert bw.parse_size("1.5G") == 3 << 29
    assert bw.sweep_sizes(1 << 20, 1 << 23, 2, 4) == [1 << 20, 1 << 21, 1 << 22, 1 << 23]
    assert bw.sweep_sizes(10, 10, 2, 4) == [8]
    with pytest.raises(ValueError):
        bw.sweep_sizes(100, 10, 2, 4)
    assert len(bw.sweep_sizes(1, 1 << 40, 1.32, 1)) <= bw.MAX_ROWS  # about 100 sizes: still taken


def test_a_factor_just_above_one_is_refused_before_listing_the_sizes():
    """-f 1.0000001 from 4 B to 64 MiB spent minutes listing some 1.7e8 sizes before any rank
    started, printing nothing (from a probe)."""
    with pytest.raises(ValueError, match="more than 100"):
        _load_module().sweep_sizes(4, 64 << 20, 1.0000001, 4)


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    cmd = [
        sys.executable,
        str(SCRIPT),
        "--nprocs",
        str(WORLD),
        "--min-bytes",
        "64K",
        "--max-bytes",
        "1M",
        "--factor",
        "4",
        "--iters",
        "2",
        "--warmup",
        "1",
        "--json",
        str(out / "r.json"),
        "-q",
    ]
    try:
        import matplotlib  # noqa: F401

        cmd += ["--plot", str(out / "r.png")]
    except ImportError:
        pass
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout, json.loads((out / "r.json").read_text()), out


def test_table_printed(sweep):
    stdout, records, _ = sweep
    assert "size(B)" in stdout and "busbw(GB/s)" in stdout and "algbw(GB/s)" in stdout
    rows = [line for line in stdout.splitlines() if line.strip() and not line.startswith("#")]
    assert len(rows) == len(records) == 6  # 64K, 256K, 1M x {compressed, allreduce}


def test_json_records(sweep):
    _, records, out = sweep
    assert {r["size_bytes"] for r in records} == {1 << 16, 1 << 18, 1 << 20}
    assert sorted(r["op"] for r in records) == ["allreduce"] * 3 + ["compressed"] * 3
    for r in records:
        assert SPEC_KEYS <= set(r), SPEC_KEYS - set(r)
        assert r["dtype"] == "float32" and r["world_size"] == WORLD and r["backend"] == "gloo"
        assert r["count"] * 4 == r["size_bytes"]
        assert r["time_us"] > 0 and r["time_min_us"] <= r["time_us"] <= r["time_max_us"]
        assert math.isclose(r["algbw_GBps"], r["size_bytes"] / (r["time_us"] * 1e-6) / 1e9, rel_tol=1e-9)
        assert math.isclose(r["busbw_GBps"], r["algbw_GBps"] * 2 * (WORLD - 1) / WORLD, rel_tol=1e-9)
        assert math.isfinite(r["rel_error"]) and 0 <= r["rel_error"] < 1
        if r["op"] == "allreduce":
            assert r["rel_error"] < 1e-5
            assert r["wire_bytes"] == 2 * (WORLD - 1) * r["size_bytes"] // WORLD
        else:
            assert r["rel_error"] > 0.1  # one 1-bit step is far from exact
    if (out / "r.png").exists():
        assert (out / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_compressed_wire_is_about_a_32nd(sweep):
    _, records, _ = sweep
    mid = {r["op"]: r for r in records if r["size_bytes"] == 1 << 18}
    n, m = WORLD, (1 << 18) // 4
    ideal = 2 * (n - 1) / n * m / 8
    assert ideal <= mid["compressed"]["wire_bytes"] <= ideal + 256  # plus a few scalars
    ratio = mid["allreduce"]["wire_bytes"] / mid["compressed"]["wire_bytes"]
    assert 30 < ratio <= 32


def test_nccl_tests_summary_codec_and_wire_bandwidth(sweep):
    stdout, records, _ = sweep
    assert "# codec: cpu: " in stdout
    averages = {
        line.rsplit("(", 1)[1].rstrip(")"): float(line.split(":")[1].split()[0])
        for line in stdout.splitlines()
        if line.startswith("# Avg bus bandwidth")
    }
    for op in ("compressed", "allreduce"):
        rows = [r for r in records if r["op"] == op]
        assert averages[op] == pytest.approx(sum(r["busbw_GBps"] for r in rows) / len(rows), rel=1e-3, abs=1e-4)
    for r in records:
        assert math.isclose(r["wire_busbw_GBps"], r["wire_bytes"] / (r["time_us"] * 1e-6) / 1e9, rel_tol=1e-2)


def test_codec_micro_benchmarks_run_every_kernel():
    """bench/test_codec_speed.py (not collected by the suite: its own pytest run) runs every
    kernel through the codec chosen for the device; it had gone on calling module-level codec
    functions that no longer exist."""
    env = {**os.environ, "COMPCOMM_BENCH_SIZES": "64K", "COMPCOMM_BENCH_ROUNDS": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--benchmark-disable",
            str(ROOT / "bench" / "test_codec_speed.py"),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    devices = 2 if torch.cuda.is_available() else 1  # the cuda kinds run too where a GPU is (14 passed on an H200)
    assert f"{7 * devices} passed" in proc.stdout


def test_main_job_says_what_one_bit_buys_on_real_links(sweep):
    """After the table: the codec speed measured here, model predictions for 1-100 Gbit/s, what
    rel_err is, and the commands that measure a real (or emulated) network."""
    stdout, _, _ = sweep
    outlook = stdout[stdout.index("# What 1-bit buys on your network") :]
    assert "loopback is not a network" in outlook and "codec passes" in outlook
    for rate in ("1gbit", "10gbit", "25gbit", "100gbit"):
        assert any(line.split()[1:2] == [rate] and line.rstrip().endswith("x") for line in outlook.splitlines())
    assert "rel_err is one call's error" in outlook
    assert "bench/netsim.py --hosts 4 --rate 10gbit --cpus-per-host 1" in outlook and "torchrun --nnodes" in outlook


@pytest.mark.mpi
def test_the_mpirun_command_the_main_job_prints_runs():
    """Without a launcher, --backend mpi prints the mpirun command to use; it must run as it is
    (as root, and with more ranks than cores)."""
    from compcomm.launch import find_mpirun

    if find_mpirun() is None:
        pytest.skip("no mpirun")
    args = ["--backend", "mpi", "--nprocs", "4", "--min-bytes", "64K", "--max-bytes", "64K", "--iters", "1", "-q"]
    hint = subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert hint.returncode != 0
    command = hint.stderr.strip().splitlines()[-1].split()
    assert command[0].endswith("mpirun") and "--oversubscribe" in command
    env = _unlaunched_environment()
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240, env=env)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "compressed" in run.stdout and "allreduce" in run.stdout


@pytest.mark.parametrize(
    "args, says",
    [
        (["--ops", "bogus"], "unknown op 'bogus'"),
        (["--ops", ","], "--ops names no op"),
        (["--iters", "0"], "--iters must be >= 1"),
        (["--factor", "nan"], "--factor must be a finite number > 1"),
        (["--json", "/proc/no/such/dir/r.json"], "argument --json: cannot write /proc/no/such/dir/r.json"),
        (["--plot", "/proc/r.png"], "argument --plot: cannot write /proc/r.png"),
    ],
)
def test_bad_arguments_are_refused_before_any_rank_starts(args, says, monkeypatch, capsys):
    """A plain run checks its arguments before spawning: one line, not a traceback per rank."""
    status, err = bench_scripts.refusal("allreduce_bw", ["--nprocs", "2", *args], monkeypatch, capsys)
    assert status != 0 and says in err, err[-2000:]


def test_an_output_path_is_checked_and_left_as_it_was_found(tmp_path):
    """Nothing is created (ranks parsing one new path used to race on the file they made and
    removed; a missing directory was made at parsing, and left behind by a run refused on
    another argument: from a probe), an existing file is left as it is, a dangling link too;
    the directory is made when the file is written."""
    records = bench_scripts.load("records")
    kept = tmp_path / "kept.json"
    kept.write_text("[]\n")
    assert records.output_path(str(kept)) == str(kept) and kept.read_text() == "[]\n"
    fresh = tmp_path / "new" / "r.json"
    assert records.output_path(str(fresh)) == str(fresh) and not (tmp_path / "new").exists()
    records.write_json([], str(fresh))
    assert fresh.read_text() == "[]\n"
    with pytest.raises(argparse.ArgumentTypeError, match="not a directory"):
        records.output_path(str(kept / "below" / "r.json"))
    link = tmp_path / "link.json"
    link.symlink_to(tmp_path / "target.json")
    assert records.output_path(str(link)) == str(link)
    assert link.is_symlink() and not (tmp_path / "target.json").exists()
    with pytest.raises(argparse.ArgumentTypeError, match="a directory"):
        records.output_path(str(tmp_path))


@pytest.mark.parametrize(
    "program, option",
    [
        ("train_step", "--json"),
        ("train_step", "--plot"),
        ("timeline", "--png"),
        ("phases", "--json"),
        ("soak", "--json"),
    ],
)
def test_other_programs_refuse_an_unwritable_output_before_running(program, option, monkeypatch, capsys):
    """--json / --plot / --png of the bench programs: an unwritable path is a usage error when
    the arguments are parsed (it failed after the run, losing what it measured)."""
    status, err = bench_scripts.refusal(program, [option, "/proc/no/r.out"], monkeypatch, capsys)
    assert status == 2 and f"argument {option}: cannot write /proc/no/r.out" in err, err


@pytest.mark.mpi
def test_under_mpirun_without_backend_mpi_the_ranks_are_one_gloo_world(tmp_path):
    """mpirun -n 2 python bench/allreduce_bw.py (gloo): the two processes form one gloo group
    and write one table, instead of each spawning a world of --nprocs ranks of its own."""
    from compcomm.launch import find_mpirun

    mpirun = find_mpirun()
    if mpirun is None:
        pytest.skip("no mpirun")
    pytest.importorskip("mpi4py")
    out = tmp_path / "r.json"
    command = [mpirun, "--allow-run-as-root", "--oversubscribe", "-n", "2", sys.executable, str(SCRIPT)]
    args = ["--nprocs", "3", "-b", "64K", "-e", "64K", "-n", "1", "-w", "0", "-q", "--json", str(out)]
    proc = subprocess.run(
        [*command, *args], cwd=ROOT, capture_output=True, text=True, timeout=240, env=_unlaunched_environment()
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stdout.count("# compcomm allreduce_bw: mpirun, world size 2, backend gloo") == 1
    records = json.loads(out.read_text())
    assert {r["world_size"] for r in records} == {2} and {r["op"] for r in records} == {"compressed", "allreduce"}


@NEEDS_FSDP_SEAMS
def test_fsdp_memory_counts_an_unsharded_error_per_rank(tmp_path):
    """bench/fsdp_memory.py: in FSDP mode each rank's error state is the whole gradient (fp32,
    one module's worth of every module), against shards of 1/n for everything else."""
    out = tmp_path / "m.json"
    cmd = [
        sys.executable,
        str(ROOT / "bench" / "fsdp_memory.py"),
        "--modes",
        "fsdp",
        "--nprocs",
        "2",
        "--steps",
        "3",
        "--json",
        str(out),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (record,) = json.loads(out.read_text())
    whole = record["unsharded_bytes"] // 4  # the model's fp32 parameters, unsharded
    assert record["error_bytes"] == whole
    assert record["params_bytes"] == whole // record["world_size"]
    peak = record["transient_peak_bytes"]  # one 1-bit reduce-scatter's transient memory
    assert peak is not None and peak <= 0.25 * record["transient_input_bytes"], peak


def test_cost_model_fits_latency_on_two_cluster_sizes():
    """bench/cost_model.py --latency: phase-0 headers of 2 and 8 ranks made from a known
    alpha0 + alpha (n - 1) give those back, and the per-call overhead is what the calibration
    run's smallest call took beyond the model's parts."""
    bench_scripts.load("collective_model")
    model = bench_scripts.load("cost_model")
    alpha0, alpha = 700e-6, 200e-6

    def records(n: int) -> list[dict]:
        header = alpha0 + alpha * (n - 1)
        return [  # emulated runs, a core per host: no CPU share
            {"world_size": n, "numel": numel, "header_s": header, "cpus_per_host": 1.0} for numel in (1 << 18, 1 << 22)
        ]

    p = {"alpha": 1.0, "burst": 0.0, "B": 1e8, "gamma": {part: 1e10 for part in model.CODEC}}
    calibration = records(2)
    for r in calibration:  # the smallest call took 1 ms more than its parts
        r["call_s"] = 0.0
    p_no_overhead = dict(p, alpha=alpha, alpha0=alpha0)
    small = calibration[0]
    calibration[0]["call_s"] = model.flat_parts(p_no_overhead, small["numel"], 2, 1.0)["call"] + 1e-3
    model.fit_latency(p, calibration, records(8), cores=2)
    assert p["alpha"] == pytest.approx(alpha) and p["alpha0"] == pytest.approx(alpha0)
    assert p["overhead"] == pytest.approx(1e-3)


@pytest.mark.parametrize("k", [2, 3])
def test_cost_model_calibrates_the_node_step_on_itself(k):
    """bench/cost_model.py --loopback: the latency of a collective inside a host comes from the
    smallest `share` and the host's bandwidth from the largest `rs` (the node's step as the
    schedule runs it: the exchange, and for k > 2 the pass summing all but the last block, which
    the model charges apart); the hierarchical model then predicts that rs back."""
    collective = bench_scripts.load("collective_model")
    model = bench_scripts.load("cost_model")
    alpha_lo, b_lo, share = 300e-6, 2e9, float(k)  # k ranks on one core

    def node_record(numel: int) -> dict:
        moved = (k - 1) * 4.0 * model.chunk(numel, k)
        return {
            "world_size": 4,
            "ranks_per_host": k,
            "cpus_per_host": 1.0,
            "numel": numel,
            "share_s": alpha_lo * (k - 1) * share,
            "rs_s": alpha_lo * (k - 1) * share + moved / b_lo + collective.node_sum(gammas, numel, k, share),
        }

    flat_run = {"world_size": 2, "numel": 1 << 24, "cpus_per_host": 1.0, "header_s": 1e-3, "allreduce_s": 1.0}
    flat_run.update({part + "_s": 1e-2 for part in ("a2a", "gather", *model.CODEC)})
    gammas = model.calibrate(flat_run, 2)  # the codec's gamma, which the node's sum runs at
    loopback = [node_record(1 << 18), node_record(1 << 24)]
    p = model.calibrate(flat_run, 2, loopback)
    assert p["alpha_lo"] == pytest.approx(alpha_lo) and p["B_lo"] == pytest.approx(b_lo)
    hier = model.hier_parts(p, 1 << 24, 2, k, share)
    assert hier["rs"] == pytest.approx(loopback[1]["rs_s"])
    small = model.hier_parts(p, 1 << 18, 2, k, share)  # its results are a few KiB: latency
    assert small["share"] == pytest.approx(loopback[0]["share_s"], rel=0.05)


def test_cost_model_overlaps_what_gloo_overlaps():
    """bench/collective_model.py charges a call over a transport that sends rows one by one
    (gloo) the longer of what runs side by side: phase 1 during the scan (rows wider than
    128 KiB: phase 0 in two headers, the rows leaving from 1/n of the scan on) and, over more
    than two ranks, phase 2 during the decode (messages that wide); with one collective per
    phase, the server error update and the own chunk's decode during phase 2."""
    model = bench_scripts.load("collective_model")
    n = 4
    p = {"alpha": 0.0, "burst": 0.0, "B": 1e8, "gamma": {part: 1e9 for part in model.CODEC}}

    def expected(numel: int, ranks: int, streamed: bool, ring: bool, params: dict = p) -> float:
        t = model.flat_parts(params, numel, ranks, 1.0, row_by_row=False)
        scan, decode, serr, gather = t["scan"], t["decode"], t["serr"], t["gather"]
        header = (ranks - 1) * model.HEADER_BYTES / params["B"]
        every_row = (ranks - 1) * model.chunk(numel, ranks) / 8 / params["B"]
        if streamed:
            phase1 = header + max(scan + header, scan / ranks + every_row)
        else:
            phase1 = scan + t["header"] + t["a2a"]
        if ring:  # n - 1 steps, each arriving chunk decoded while the next one travels
            step, own = gather / (ranks - 1), decode / ranks
            phase2 = max(step, serr + own) + (ranks - 2) * max(step, own) + own
        else:
            phase2 = max(gather, serr + decode / ranks) + decode * (ranks - 1) / ranks
        return phase1 + t["server"] + phase2

    edge = 4 << 20  # rows of exactly 128 KiB on 4 ranks: not streamed; messages of 4 + 128 KiB: the ring
    for numel, ranks, streamed, ring in [
        (25 << 20, n, True, True),
        (edge, n, False, True),
        (edge + 32, n, True, True),
        (25 << 20, 2, True, False),  # two ranks: no ring
        (1 << 16, n, False, False),
    ]:
        got = model.flat_parts(p, numel, ranks, 1.0)["call"]
        assert got == pytest.approx(expected(numel, ranks, streamed, ring), rel=1e-9), (numel, ranks)
    slow_link = dict(p, B=5e6)  # a step outlasts serr + decode / n: the ring hides all but the last chunk's decode
    t = model.flat_parts(slow_link, 25 << 20, n, 1.0)
    plain = model.flat_parts(slow_link, 25 << 20, n, 1.0, row_by_row=False)
    assert t["gather"] / (n - 1) >= t["serr"] + t["decode"] / n
    assert t["call"] < plain["call"]
    # A step longer than a chunk's decode but shorter than the server error update and the own
    # chunk's decode: the first step waits for those, the later ones for the wire, the last
    # chunk's decode comes after. (max(gather + decode / n, serr + decode) was short by
    # serr + decode / n - step here.)
    band = dict(p, gamma={**p["gamma"], "serr": 5e9, "decode": 1e10})
    t = model.flat_parts(band, 25 << 20, n, 1.0)
    step, own = t["gather"] / (n - 1), t["decode"] / n
    assert own < step < t["serr"] + own
    assert t["call"] == pytest.approx(expected(25 << 20, n, True, True, band), rel=1e-9)
    phase1_and_server = expected(25 << 20, n, True, False, band) - (
        max(t["gather"], t["serr"] + own) + t["decode"] * (n - 1) / n
    )
    assert t["call"] - phase1_and_server == pytest.approx(t["serr"] + 2 * own + (n - 2) * step, rel=1e-9)

    # The hierarchical call: the node's exchange (and for k > 2 a pass summing the first k - 1
    # blocks), the call across hosts whose scan also reads the last block and which decodes its
    # own part in its phase 2, the results shared, the other k - 1 parts decoded.
    hosts, numel = 2, 25 << 20
    p_node = dict(p, alpha_lo=1e-4, B_lo=1e9)
    for k in (2, 3):
        part = model.chunk(numel, k)
        hier = model.hier_parts(p_node, numel, hosts, k, 1.0)
        inner = model.flat_parts(p_node, part, hosts, 1.0, 1, sharing_link=k, addend=True)
        plain = model.flat_parts(p_node, part, hosts, 1.0, 1, sharing_link=k)
        assert inner["scan"] == pytest.approx(plain["scan"] + 4.0 * part / p["gamma"]["scan"])
        summed = 4.0 * k * part / p["gamma"]["scan"] if k > 2 else 0.0
        assert hier["rs"] == pytest.approx(model.node_time(p_node, (k - 1) * 4.0 * part, k, 1.0) + summed)
        others = (k - 1) / k * model.flat_bytes(numel, 1)["decode"] / p["gamma"]["decode"]
        assert hier["hier"] == pytest.approx(hier["agree"] + hier["rs"] + inner["call"] + hier["share"] + others)


def test_cost_model_spends_one_token_bucket_per_call():
    """A host link's token bucket lets a burst through at once and then refills at the link's
    rate: each phase timed alone finds it full, but a call's phases spend one bucket between
    them, in the order they leave (phase 0, phase 1, phase 2), so a call whose phases each fit
    in the bucket still sends what they add up to beyond it at the link's bandwidth."""
    model = bench_scripts.load("collective_model")
    n, numel, bandwidth, burst = 4, 10 << 20 >> 2, 1e8, 256 * 1024
    p = {"alpha": 0.0, "burst": float(burst), "B": bandwidth, "gamma": {part: 1e18 for part in model.CODEC}}
    b = model.flat_bytes(numel, n)
    phases = [b["header"], b["a2a"], b["gather"]]
    assert all(0 < sent < burst for sent in phases) and sum(phases) > burst
    t = model.flat_parts(p, numel, n, 1.0, row_by_row=False)
    assert t["header"] == t["a2a"] == t["gather"] == 0.0  # alone, each leaves at once
    assert t["call"] == pytest.approx((sum(phases) - burst) / bandwidth, rel=1e-6)
    assert model.spend_bucket(burst, phases) == [phases[0], phases[1], burst - phases[0] - phases[1]]
    streamed = model.flat_parts(p, numel, n, 1.0)  # rows of 80 KiB: gloo sends them in one all-to-all too
    assert streamed["call"] == pytest.approx(t["call"], rel=1e-6)


def test_cost_model_mirrors_the_library_thresholds():
    """bench/collective_model.py runs without compcomm, so it copies the thresholds that decide
    what a call folds and overlaps; they must stay the library's."""
    from compcomm.agreement import FOLD_BYTES, HEADER
    from compcomm.backends.torch_dist import DIRECT_GATHER_BYTES

    model = bench_scripts.load("collective_model")
    assert model.FOLD_BYTES == FOLD_BYTES
    assert model.ROW_BY_ROW_BYTES == DIRECT_GATHER_BYTES
    assert model.HEADER_BYTES == HEADER.itemsize


def test_timeline_records_every_step_of_both_calls(tmp_path):
    """bench/timeline.py on 4 self-spawned ranks, 2 per host: every timed call of each kind has
    every rank's spans, inside the call, with the steps its schedule runs, and its CPU time."""
    out = tmp_path / "t.json"
    cmd = [sys.executable, str(ROOT / "bench" / "timeline.py"), "--size", "1M", "--calls", "2", "--warmup", "1"]
    env = _unlaunched_environment()
    proc = subprocess.run(cmd + ["--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "== flat" in proc.stdout and "== hierarchical" in proc.stdout and "rank 3 scan" in proc.stdout
    report = json.loads(out.read_text())
    assert report["meta"]["world_size"] == 4 and report["meta"]["ranks_per_host"] == 2
    calls = report["calls"]
    assert sorted((c["kind"], c["call"]) for c in calls) == [
        ("flat", 0),
        ("flat", 1),
        ("hierarchical", 0),
        ("hierarchical", 1),
    ]
    expected = {
        "flat": {"call", "phase 0", "scan", "phase 1", "server", "error update", "phase 2", "decode"},
        "hierarchical": {"call", "phase 0", "node exchange", "scan", "server", "phase 2", "decode", "share"},
    }
    for call in calls:
        assert [r["rank"] for r in call["ranks"]] == [0, 1, 2, 3] and call["links"] == []
        for r in call["ranks"]:
            steps = {s for s, _, _ in r["spans"]}
            assert expected[call["kind"]] <= steps, (call["kind"], steps)
            assert r["cpu_ms"] > 0
            assert all(0 <= a <= b <= call["time_ms"] + 1e-3 for _, a, b in r["spans"])


def test_timeline_counts_each_step_once_and_marks_unsampled_sends():
    timeline = bench_scripts.load("timeline")
    spans = [["scan", 1.0, 3.0], ["scan", 2.0, 4.0], ["phase 0", 0.0, 9.0], ["scan", 6.0, 7.0]]
    assert timeline.busy(spans, "scan") == (4.0, 1.0, 7.0)  # [1, 4] and [6, 7]
    assert timeline.busy(spans, "share")[0] == 0.0
    samples = [[0.0, 0], [1.0, 100], [5.0, 100], [9.0, 500], [9.5, 600]]
    assert timeline.link_bytes(samples, 0.0, 1.0) == 100 and timeline.link_bytes(samples, 0.5, 7.0) == 250
    assert timeline.blind_spots(samples) == [(5.0, 9.0)]  # idle gaps are known: nothing was sent


def test_timeline_divides_times_but_not_cpu_by_the_dilation(monkeypatch):
    """Emulated at d = 2: spans and call times halve, from the earliest rank's start; CPU time
    stays (a host's C / d real cores are its C emulated ones); the link's bytes count from the
    sample before the call, and a lane shows busy, idle and unsampled cells."""
    timeline = bench_scripts.load("timeline")
    monkeypatch.setenv("NETSIM_DILATION", "2")
    records = [
        [{"kind": "flat", "call": 0, "spans": [("call", 10.0, 10.2), ("scan", 10.01, 10.05)], "cpu_s": 0.15,
          "link": [(9.99, 1000)] + [(10.0 + 0.002 * i, 1000 + 1000 * min(i, 50)) for i in range(101)]}],
        [{"kind": "flat", "call": 0, "spans": [("call", 10.02, 10.16)], "cpu_s": 0.05, "link": None}],
    ]  # fmt: skip
    (call,) = timeline.assemble({"per_host": 2, "records": records})
    assert math.isclose(call["time_ms"], 100.0)
    rank0, rank1 = call["ranks"]
    assert rank0["cpu_ms"] == 150.0 and rank1["cpu_ms"] == 50.0
    assert [s[0] for s in rank0["spans"]] == ["call", "scan"] and rank0["spans"][1][1:] == [5.0, 25.0]
    assert rank1["spans"][0][1:] == [10.0, 80.0]
    (link,) = call["links"]
    assert link["host"] == 0 and link["samples"][0] == [-5.0, 0] and link["samples"][-1] == [100.0, 50000]
    # sampled every emulated ms: 1000 bytes a ms for 50 ms, then idle; at 1 KB/ms half the call is busy
    assert timeline.link_cells(link, 100.0, 4, 1000.0) == ["#", "#", ".", "."]
    gappy = {"samples": [[0.0, 0], [10.0, 0], [40.0, 30000], [50.0, 30000]]}
    assert timeline.link_cells(gappy, 50.0, 5, 1000.0) == [".", "?", "?", "?", "."]

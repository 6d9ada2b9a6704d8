"""bench/emulation.py: under bench/netsim.py's time dilation (NETSIM_DILATION = d) the benchmarks
report measured times divided by d, and say so in their tables and JSON records.

The benchmarks' own timers are replaced by a clock that advances one second per reading, so
every measured interval is exactly one second and the reported one must be 1 / d."""

from __future__ import annotations

import argparse
import importlib.util
import socket
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _load(name: str):
    if str(BENCH) not in sys.path:  # as when run as a script: its helpers sit beside it
        sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


class OneSecondClock:
    """time.perf_counter for the benchmark under test: each reading is a second after the last."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


@pytest.fixture
def one_rank_group():
    """A gloo group of this process alone, which the benchmarks' timed loops need."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_dilation_from_the_environment(monkeypatch):
    emulation = _load("emulation")
    monkeypatch.delenv("NETSIM_DILATION", raising=False)
    monkeypatch.delenv("NETSIM_CPUS_PER_HOST", raising=False)
    assert emulation.dilation() == 1 and emulation.emulated(3.0) == 3.0 and emulation.label() == ""
    assert emulation.record_fields() == {"emulated": False, "dilation": 1.0, "cpus_per_host": None}
    monkeypatch.setenv("NETSIM_DILATION", "2.5")
    monkeypatch.setenv("NETSIM_CPUS_PER_HOST", "1")
    assert emulation.emulated(5.0) == 2.0 and emulation.label() == "emulated (time / d), d = 2.5"
    assert emulation.record_fields() == {"emulated": True, "dilation": 2.5, "cpus_per_host": 1.0}
    for bad in ("0.5", "fast", "nan"):
        monkeypatch.setenv("NETSIM_DILATION", bad)
        with pytest.raises(ValueError, match="NETSIM_DILATION"):
            emulation.dilation()


def test_allreduce_bw_divides_its_times_by_d(monkeypatch, one_rank_group, capsys):
    bw = _load("allreduce_bw")
    from compcomm import backends

    monkeypatch.setenv("NETSIM_DILATION", "4")
    monkeypatch.setattr(bw.time, "perf_counter", OneSecondClock())
    args = bw.build_parser().parse_args(["--iters", "2", "--warmup", "1"])
    x = torch.randn(1024)
    rec = bw.measure("allreduce", backends.get("gloo"), x, x.clone(), args, x.numel() * 4)
    assert rec["time_us"] == rec["time_min_us"] == rec["time_max_us"] == pytest.approx(0.25e6)
    assert rec["algbw_GBps"] == pytest.approx(4096 / 0.25 / 1e9)
    assert rec["emulated"] is True and rec["dilation"] == 4
    bw.print_header(args, 1, "test")
    assert "# times: emulated (time / d), d = 4" in capsys.readouterr().out


def test_train_step_divides_its_step_times_by_d(monkeypatch, one_rank_group):
    ts = _load("train_step")
    monkeypatch.setenv("NETSIM_DILATION", "4")
    args = ts.parse_args(
        ["--context", "4", "--embed", "4", "--hidden", "8", "--batch", "2", "--steps", "3", "--warmup-steps", "1"]
        + ["--methods", "ddp_adamw"]  # (PowerSGD, among all methods, needs a warm-up of 2)
    )
    text = torch.randint(1, 20, (200,))
    monkeypatch.setattr(ts.time, "perf_counter", OneSecondClock())
    res = ts.train(ts.alone, args, text)
    assert res["times"] == [0.25] * 3
    rec = ts.summarize("alone", res, args, 1)
    assert rec["step_time_ms"] == 250 and rec["step_times_ms"] == [250] * 3


def test_train_step_records_say_emulated(monkeypatch, capsys):
    ts = _load("train_step")
    monkeypatch.setenv("NETSIM_DILATION", "2")
    args = argparse.Namespace(
        shape=(4, 4, 8, 2),
        steps=2,
        warmup_steps=1,
        setting="test",
        seed=0,
        json=None,
        plot=None,
        quiet=True,
        backend="gloo",
    )
    res = {"times": [0.1, 0.1], "losses": [1.0, 1.0], "sent": [0.0, 0.0], "comm": [None, None]}
    records: list[dict] = []
    monkeypatch.setattr(ts, "write_json", lambda recs, path: records.extend(recs))
    args.json = "/dev/null"
    ts.report({"ddp_sgd": res}, args, 1, "test")
    assert records[0]["emulated"] is True and records[0]["dilation"] == 2
    assert "# times: emulated (time / d), d = 2" in capsys.readouterr().out


def test_optim_overlap_divides_its_step_times_by_d(monkeypatch, one_rank_group, capsys):
    """Its step times were wall-clock under netsim's dilation, its table and records unlabelled."""
    oo = _load("optim_overlap")
    monkeypatch.setenv("NETSIM_DILATION", "4")
    args = oo.parse_args(["--layers", "1", "--width", "8", "--batch", "2", "--steps", "2"])
    monkeypatch.setattr(oo, "time", types.SimpleNamespace(perf_counter=OneSecondClock()))  # its own readings only
    records = oo.rank_main(args)
    assert [r["step_ms_no_overlap"] for r in records] == [250.0, 250.0]
    assert [r["step_ms_overlap"] for r in records] == [250.0, 250.0]
    assert all(r["emulated"] is True and r["dilation"] == 4 for r in records)


def test_phases_labels_its_table_as_emulated(monkeypatch, one_rank_group, capsys):
    ph = _load("phases")
    monkeypatch.setenv("NETSIM_DILATION", "2")
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr(
        ph, "measure", lambda be, numel, iters, parts, hier: {"scan_s": 1.0, "world_size": 1, "size_bytes": 4 * numel}
    )
    ph.time_parts(argparse.Namespace(sizes=[4096], iters=1, parts=["scan"], json=None))
    assert "# times: emulated (time / d), d = 2" in capsys.readouterr().out

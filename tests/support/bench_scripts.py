"""bench/ programs as modules, loaded the way `python bench/<prog>.py` runs them.

A program finds its helper modules (bench/ranks.py, bench/units.py, ...) because Python puts
the script's directory first on sys.path; a test that loads one by path must do the same.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[2] / "bench"


def load(name: str) -> ModuleType:
    """bench/<name>.py as module `name`, with bench/ on sys.path for its helpers."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None, name
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


LAUNCH_VARIABLES = ("OMPI_", "PMIX_", "RANK", "WORLD_SIZE")
"""Prefixes of the variables of an MPI or torchrun launch."""


def refusal(name: str, argv: list[str], monkeypatch, capsys) -> tuple[int, str]:
    """`python bench/<name>.py *argv`, run in this process as a plain (unlaunched) run would until
    it refuses its arguments: its exit status and what it wrote to stderr. A run that got past
    its checks to spawning ranks fails the test (in a fresh interpreter each such check cost
    more than a second of the suite's two cores, for a parse)."""
    import torch

    from compcomm import launch

    for variable in list(os.environ):
        if variable.startswith(LAUNCH_VARIABLES):
            monkeypatch.delenv(variable)
    monkeypatch.setattr(sys, "argv", [str(BENCH / f"{name}.py"), *argv])
    monkeypatch.setattr(launch, "spawn", _spawned)
    threads = torch.get_num_threads()
    module = load(name)
    try:
        status = module.main(argv)
    except SystemExit as exc:  # as the interpreter ends on it: a message goes to stderr, status 1
        status = 0 if exc.code is None else exc.code if isinstance(exc.code, int) else 1
        if not isinstance(exc.code, int | None):
            print(exc.code, file=sys.stderr)
    finally:
        torch.set_num_threads(threads)
    return status, capsys.readouterr().err


def _spawned(*args, **kwargs):
    raise AssertionError("the arguments were accepted: ranks were about to be spawned")

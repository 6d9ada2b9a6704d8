"""bench/ programs as modules, loaded the way `python bench/<prog>.py` runs them.

A program finds its helper modules (bench/ranks.py, bench/units.py, ...) because Python puts
the script's directory first on sys.path; a test that loads one by path must do the same.
"""

from __future__ import annotations

import importlib.util
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

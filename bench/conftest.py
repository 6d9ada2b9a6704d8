"""pytest hooks for the bench/ micro-benchmarks: a GB/s summary relative to memcpy."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

_TABLE: dict[tuple[str, int], float] = {}


@pytest.fixture(scope="session")
def gbps_table() -> dict[tuple[str, int], float]:
    """(kernel, elements) -> GB/s, filled by the benchmarks and printed at the end."""
    return _TABLE


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not _TABLE:
        return
    kernels = list(dict.fromkeys(k for k, _ in _TABLE))
    sizes = sorted({n for _, n in _TABLE})
    tr = terminalreporter
    tr.section("codec GB/s (fp32 bytes / median time) and fraction of copy")
    tr.write_line(f"{'elements':>10} " + " ".join(f"{k:>22}" for k in kernels))
    for n in sizes:
        copy = _TABLE.get(("copy", n))
        cells = []
        for k in kernels:
            g = _TABLE.get((k, n))
            if g is None:
                cells.append(f"{'-':>22}")
            elif copy and k != "copy":
                cells.append(f"{g:>9.2f} GB/s ({g / copy:5.1%})")
            else:
                cells.append(f"{g:>9.2f} GB/s        ")
        tr.write_line(f"{n:>10d} " + " ".join(cells))

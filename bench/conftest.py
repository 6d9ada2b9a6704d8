"""pytest hooks for the bench/ micro-benchmarks: a GB/s summary relative to memcpy."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

_TABLE: dict[tuple[str, str, int], float] = {}


@pytest.fixture(scope="session")
def gbps_table() -> dict[tuple[str, str, int], float]:
    """(device, kernel, elements) -> GB/s, filled by the benchmarks and printed at the end."""
    return _TABLE


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not _TABLE:
        return
    kernels = list(dict.fromkeys(k for _, k, _ in _TABLE))
    tr = terminalreporter
    tr.section("codec GB/s (fp32 bytes / median time) and fraction of copy")
    for device in dict.fromkeys(d for d, _, _ in _TABLE):
        tr.write_line(f"{device:>10} " + " ".join(f"{k:>22}" for k in kernels))
        for n in sorted({n for d, _, n in _TABLE if d == device}):
            copy = _TABLE.get((device, "copy", n))
            cells = []
            for k in kernels:
                g = _TABLE.get((device, k, n))
                if g is None:
                    cells.append(f"{'-':>22}")
                elif copy and k != "copy":
                    cells.append(f"{g:>9.2f} GB/s ({g / copy:5.1%})")
                else:
                    cells.append(f"{g:>9.2f} GB/s        ")
            tr.write_line(f"{n:>10d} " + " ".join(cells))

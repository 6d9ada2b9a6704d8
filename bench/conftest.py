"""pytest hooks for the bench/ micro-benchmarks: a GB/s summary relative to memcpy."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

_TABLE: dict[tuple[str, str, int], float] = {}


@pytest.fixture(scope="session")
def gbps_table() -> dict[tuple[str, str, int], float]:
    """(configuration, kernel, elements) -> GB/s, filled by the benchmarks and printed at the end.
    A copy's configuration is "<device> T=<threads>"; a codec kernel's adds its dtype and kernel
    set, and is compared with the copy whose configuration starts its own."""
    return _TABLE


def _copy_of(config: str) -> str:
    return " ".join(config.split()[:2])


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not _TABLE:
        return
    kernels = [k for k in dict.fromkeys(k for _, k, _ in _TABLE) if k != "copy"]
    tr = terminalreporter
    tr.section("codec GB/s (4 bytes per element / median time) and fraction of copy")
    from compcomm import codec_info

    tr.write_line(f"codec: {', '.join(f'{device}: {what}' for device, what in codec_info().items())}")
    for setup in dict.fromkeys(c for c, k, _ in _TABLE if k != "copy"):
        tr.write_line(f"{setup:<24} {'copy':>10} " + " ".join(f"{k:>20}" for k in kernels))
        for n in sorted({n for c, _, n in _TABLE if c == setup}):
            copy = _TABLE.get((_copy_of(setup), "copy", n))
            cells = []
            for k in kernels:
                g = _TABLE.get((setup, k, n))
                if g is None:
                    cells.append(f"{'-':>20}")
                elif copy:
                    cells.append(f"{g:>7.2f} GB/s ({g / copy:6.1%})")
                else:
                    cells.append(f"{g:>7.2f} GB/s         ")
            copy_cell = f"{copy:>5.2f} GB/s" if copy else f"{'-':>10}"
            tr.write_line(f"{n:>24d} {copy_cell} " + " ".join(cells))

"""Emulated times, for benchmarks run in bench/netsim.py's time-dilated cluster.

Under `bench/netsim.py --cpus-per-host C`, where the hosts need more cores than this machine has,
the whole cluster runs d times slower than the one it emulates (each host C / d of a core, links
at rate / d, delays x d; docs/guides/measuring.md). A time measured there, divided by d, is the emulated
cluster's time; a ratio of two such times needs no rescaling. netsim passes d to the ranks as
NETSIM_DILATION (1 when not dilated; absent outside netsim).

A benchmark reports every time through `emulated()`, labels its table with `label()` and adds
`record_fields()` to each JSON record, so a reader always knows which times were rescaled.
"""

from __future__ import annotations

import math
import os


def dilation() -> float:
    """The dilation d of this run: NETSIM_DILATION, or 1 outside netsim."""
    text = os.environ.get("NETSIM_DILATION", "").strip()
    if not text:
        return 1.0
    try:
        d = float(text)
    except ValueError:
        raise ValueError(f"NETSIM_DILATION must be a number >= 1, got {text!r}") from None
    if not math.isfinite(d) or d < 1:
        raise ValueError(f"NETSIM_DILATION must be a number >= 1, got {text!r}")
    return d


def emulated(seconds: float) -> float:
    """A measured time as the emulated cluster's: divided by d."""
    return seconds / dilation()


def label() -> str:
    """The table's note on its times: empty where they are plain wall-clock times."""
    d = dilation()
    return f"emulated (time / d), d = {d:g}" if d != 1 else ""


def record_fields() -> dict[str, object]:
    """The keys every JSON record carries: whether its times were divided by a dilation, by
    which, and the cores per emulated host (None where the hosts had no CPU quota)."""
    d = dilation()
    cpus = os.environ.get("NETSIM_CPUS_PER_HOST", "").strip()
    return {"emulated": d != 1, "dilation": d, "cpus_per_host": float(cpus) if cpus else None}

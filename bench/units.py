"""Sizes, link rates and delays as they are written on the benchmarks' command lines ("64K", "1gbit").

No torch here: bench/netsim.py parses its `--rate` with this module before any rank exists,
and stays a plain-Python tool.
"""

from __future__ import annotations

import argparse
import re

_SIZE_UNITS = {
    "": 1,
    "B": 1,
    "K": 1 << 10,
    "KB": 1 << 10,
    "KIB": 1 << 10,
    "M": 1 << 20,
    "MB": 1 << 20,
    "MIB": 1 << 20,
    "G": 1 << 30,
    "GB": 1 << 30,
    "GIB": 1 << 30,
}
_RATE_UNITS = {
    "bit": 1,
    "kbit": 1e3,
    "mbit": 1e6,
    "gbit": 1e9,
    "tbit": 1e12,
    "bps": 8,
    "kbps": 8e3,
    "mbps": 8e6,
    "gbps": 8e9,
    "tbps": 8e12,
}
_NUMBER_AND_UNIT = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*")


def parse_size(text: str) -> int:
    """'1M' -> 1048576 (binary units, as nccl-tests reads them); plain integers are bytes.
    Usable as an argparse `type`."""
    m = _NUMBER_AND_UNIT.fullmatch(str(text))
    if not m or m.group(2).upper() not in _SIZE_UNITS:
        raise argparse.ArgumentTypeError(f"bad size {text!r}; use e.g. 4096, 64K, 1M, 256M, 1G")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).upper()])


def human(nbytes: float) -> str:
    """A size for people: 1048576 -> '1 MiB'."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes:g} B"


def parse_rate(text: str) -> float:
    """A rate in tc's syntax ("1gbit", "100mbit", "125mbps") in bits per second, as the links
    of bench/netsim.py are shaped. Usable as an argparse `type`."""
    m = _NUMBER_AND_UNIT.fullmatch(text)
    if not m:
        raise argparse.ArgumentTypeError(f"bad rate {text!r}; use tc syntax such as 1gbit or 100mbit")
    unit = (m.group(2) or "bit").lower()
    if unit not in _RATE_UNITS:
        raise argparse.ArgumentTypeError(f"bad rate unit {unit!r} in {text!r}; use one of {', '.join(_RATE_UNITS)}")
    value = float(m.group(1)) * _RATE_UNITS[unit]
    if value <= 0:
        raise argparse.ArgumentTypeError(f"rate must be positive, got {text!r}")
    return value


_TIME_UNITS = {"s": 1.0, "sec": 1.0, "ms": 1e-3, "msec": 1e-3, "us": 1e-6, "usec": 1e-6}


def parse_delay(text: str) -> float:
    """A delay with its unit ("20ms", "0.1ms", "500us", "1s") in seconds.

    The unit is required: tc reads a bare number as microseconds, a reader would not."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]+)\s*", text)
    if not m or m.group(2).lower() not in _TIME_UNITS:
        raise ValueError(f"bad delay {text!r}; give a number and a unit: s, ms or us (e.g. 20ms)")
    return float(m.group(1)) * _TIME_UNITS[m.group(2).lower()]

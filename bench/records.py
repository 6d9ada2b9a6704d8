"""What the benchmarks report: their JSON files, the relative error their tables show, and the
codec their headers name.

One writer, so that every `--json PATH` of bench/ behaves alike: the directory is made, the
records are indented one space (diffable in bench/results/), and the file ends with a newline;
and one check of such a path (`output_path`), made when the arguments are parsed, so that a run
never ends by failing to write what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import torch


def output_path(path: str) -> str:
    """argparse type of an output file (--json, --plot, --png): `path`, once its directory is
    made and the file can be opened for writing (an existing file is left as it is)."""
    existed = os.path.exists(path)
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "a"):
            pass
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot write {path}: {exc.strerror or exc}") from None
    if not existed:
        os.remove(path)
    return path


def write_json(records: Any, path: str) -> None:
    """Write `records` (a list of records, or one report) as JSON to `path`."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(records, f, indent=1)
        f.write("\n")


def rel_error(out: torch.Tensor, exact: torch.Tensor) -> float:
    """||out - exact|| / ||exact|| in float64 (SPEC 7's rel_error; the plain norm of the
    difference where exact is zero)."""
    diff = out.double() - exact.double()
    norm = float(exact.double().norm())
    return float(diff.norm()) / norm if norm > 0 else float(diff.norm())


def codec_line() -> str:
    """The header line naming the codec that ran on each device (native C and its instruction
    set, CUDA, or the torch fallback): every timed table carries it, so that a build that lost
    the fast codec shows in its figures."""
    import compcomm

    return "# codec: " + ", ".join(f"{device}: {what}" for device, what in compcomm.codec_info().items())

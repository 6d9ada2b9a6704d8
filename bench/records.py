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
import tempfile
from typing import Any

import torch


def output_path(path: str) -> str:
    """argparse type of an output file (--json, --plot, --png): `path`, once it is known that it
    can be written. An existing file is opened for appending (its contents left as they are);
    otherwise a temporary file is made and removed in the directory where the file would go
    (for a dangling link, its target's; where that directory is missing, in its nearest
    existing ancestor, the directory being made when the file is written: `make_parent`), so
    that nothing is left behind, also by a run refused afterwards, and ranks that all parse the
    same path do not race."""
    try:
        if not path or os.path.isdir(path):
            raise IsADirectoryError(21, "a directory, not a file")
        if os.path.isfile(path):
            with open(path, "a"):
                pass
        else:
            _writable_directory(os.path.dirname(os.path.realpath(path)))
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot write {path}: {exc.strerror or exc}") from None
    return path


def output_dir(path: str) -> str:
    """argparse type of an output directory (--out): `path`, once a file can be written in it
    (made when the first file is), so that a run never ends by failing to write what it
    measured."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{path} exists and is not a directory")
    try:
        _writable_directory(path)
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot write in {path}: {exc.strerror or exc}") from None
    return path


def _writable_directory(directory: str) -> None:
    """OSError unless files can be made in `directory`: a temporary file made and removed in it,
    or where it is missing in its nearest existing ancestor (where its folders would be made)."""
    existing = directory
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise NotADirectoryError(20, f"{existing} is not a directory")
    with tempfile.TemporaryFile(dir=existing):
        pass


def make_parent(path: str) -> str:
    """`path`, once the directory it goes in exists (made if missing): before writing it."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    return path


def write_json(records: Any, path: str) -> None:
    """Write `records` (a list of records, or one report) as JSON to `path`."""
    with open(make_parent(path), "w") as f:
        json.dump(records, f, indent=1)
        f.write("\n")


def rel_error(out: torch.Tensor, exact: torch.Tensor) -> float:
    """||out - exact|| / ||exact|| in float64 (the records' `rel_error`; the plain norm of the
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

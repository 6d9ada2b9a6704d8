"""What the multi-rank test programs (tests/programs/) share: inputs, byte comparisons, and the
loop that runs named checks and writes each rank's results for the tests to assert on."""

from __future__ import annotations

import hashlib
import json
import os
import time
import traceback
from collections.abc import Callable

import torch

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
TOLERANCE = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1e-2}


class CheckFailed(AssertionError):
    pass


def expect(condition: bool, message: str) -> None:
    if not condition:
        raise CheckFailed(message)


def make_input(rank: int, step: int, numel: int, dtype: str, seed: int = 0) -> torch.Tensor:
    """Rank `rank`'s input of call `step`: the same on every run and in every program."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + rank)
    return (torch.randn(numel, generator=g) * (rank + 1) + 0.1 * step).to(DTYPES[dtype])


def raw(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).cpu().view(torch.uint8).numpy().tobytes()


def digest(*tensors: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(raw(t))
    return h.hexdigest()


def run_checks(
    checks: dict[str, Callable[[], dict | None]],
    path: str,
    results: dict | None = None,
    between: Callable[[], None] | None = None,
) -> None:
    """Run each check; after each, rewrite `path` (atomically) with {name: {"ok", "detail",
    "seconds", ...values}} added to `results`, so a failed or killed run still says how far it
    got; then call `between` (e.g. a barrier, so a failed check leaves no rank mid-collective)."""
    results = dict(results or {})
    for name, check in checks.items():
        started = time.perf_counter()
        try:
            results[name] = {"ok": True, "detail": "", **(check() or {})}
        except Exception as exc:  # noqa: BLE001 - reported to the test, which fails with it
            results[name] = {"ok": False, "detail": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"}
        results[name]["seconds"] = round(time.perf_counter() - started, 3)
        with open(path + ".tmp", "w") as f:
            json.dump(results, f, indent=1, default=str)
        os.replace(path + ".tmp", path)
        if between is not None:
            between()

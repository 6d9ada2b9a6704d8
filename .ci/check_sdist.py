"""Build the sdist and check that it holds every tracked file its tests, benchmarks and examples use.

Run from the repository root (by .ci/run). Exits non-zero naming what is missing.
"""

from __future__ import annotations

import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

NEEDED = (
    "tests/",
    "bench/",
    "examples/",
    "compcomm/",
    "backends/",
    "setup.py",
    "pyproject.toml",
    "README.md",
    "LICENSE",
    "CHANGELOG.md",
)


def main() -> int:
    tracked = subprocess.run(["git", "ls-files"], capture_output=True, text=True, check=True).stdout.split()
    wanted = {f for f in tracked if f.startswith(NEEDED) and not f.startswith("bench/results/")}
    with tempfile.TemporaryDirectory() as out:
        subprocess.run(
            [sys.executable, "-m", "build", "--sdist", "--no-isolation", "--outdir", out],
            check=True,
            capture_output=True,
            text=True,
        )
        (sdist,) = Path(out).glob("compcomm-*.tar.gz")
        with tarfile.open(sdist) as tar:
            names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    missing = sorted(wanted - names)
    if missing:
        print(f"{sdist.name} lacks {len(missing)} tracked file(s): {', '.join(missing)}", file=sys.stderr)
        return 1
    print(f"sdist ok: {len(wanted)} tracked files present")
    return 0


if __name__ == "__main__":
    sys.exit(main())

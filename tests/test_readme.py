"""The README's first usage snippet runs as written on 4 ranks started like torchrun starts them."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from rankpool import free_port

ROOT = Path(__file__).resolve().parents[1]


def first_python_block() -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index("## Usage")
    return re.search(r"```python\n(.*?)```", text[start:], re.S).group(1)


def test_usage_snippet_runs_on_four_ranks(tmp_path):
    script = tmp_path / "example.py"
    script.write_text(first_python_block())
    port, procs = free_port(), []
    for rank in range(4):
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": "4",
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": "4",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script)],
                cwd=tmp_path,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    outputs = [p.communicate(timeout=180) for p in procs]
    for rank, (p, (_, err)) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"rank {rank} failed:\n{err[-3000:]}"
    assert sorted(f.name for f in tmp_path.glob("ef_rank*.pt")) == [f"ef_rank{r}.pt" for r in range(4)]

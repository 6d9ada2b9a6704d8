"""Every script in examples/ runs as a user would run it, on 4 local ranks: plainly (it spawns
its ranks itself), and one of them under torchrun; each must exit 0, print its OK line and leave
no files behind: its checkpoints go to a temporary directory of its own, removed at the end."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fsdp_models import NEEDS_FSDP_SEAMS

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
SCRIPTS = ("collective", "ddp_hook_sgd", "onebit_adam", "fsdp", "hsdp", "diloco", "hierarchical")
HELPER = "_ranks"  # the launcher the examples share


def run_example(command: list[str], tmp_path: Path) -> str:
    """Run `command` in an empty directory, with a temporary directory of its own (TMPDIR): its
    output, once it is known that it left neither."""
    cwd, tmp = tmp_path / "cwd", tmp_path / "tmp"
    cwd.mkdir()
    tmp.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp)}
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{command} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    assert not list(cwd.iterdir()), f"{command} left files in its working directory: {sorted(cwd.iterdir())}"
    assert not list(tmp.glob("compcomm-example-*")), f"{command} left its checkpoints: {sorted(tmp.iterdir())}"
    return done.stdout


def test_every_example_is_tested_and_shows_how_to_launch_it():
    assert sorted(p.stem for p in EXAMPLES.glob("*.py")) == sorted((*SCRIPTS, HELPER))
    for name in SCRIPTS:
        doc = ast.get_docstring(ast.parse((EXAMPLES / f"{name}.py").read_text()))
        assert doc is not None and f"python examples/{name}.py" in doc, name
        assert "torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d" in doc, name


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=NEEDS_FSDP_SEAMS) if n in ("fsdp", "hsdp") else n for n in SCRIPTS]
)
def test_example_runs_on_four_spawned_ranks(name, tmp_path):
    out = run_example([sys.executable, str(EXAMPLES / f"{name}.py")], tmp_path)
    assert f"{name}: OK" in out, out


def test_example_runs_under_torchrun(tmp_path):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"]
    out = run_example([*command, str(EXAMPLES / "collective.py")], tmp_path)
    assert "collective: OK" in out, out

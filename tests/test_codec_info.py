"""What runs the codec is named (`compcomm.codec_info()`), and losing the C codec is loud:
the build stops unless told to go on without it, and the first use of the fallback warns."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import compcomm
from compcomm import _native

ROOT = Path(__file__).resolve().parents[1]


def run(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        args, cwd=cwd, capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1", **env}
    )


def source_copy(tmp_path: Path) -> Path:
    """The package's sources laid out as installed (backends inside compcomm), with no built C codec."""
    tree = tmp_path / "src"
    shutil.copytree(ROOT / "compcomm", tree / "compcomm", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    shutil.copytree(ROOT / "backends", tree / "compcomm" / "backends", ignore=shutil.ignore_patterns("__pycache__"))
    return tree


def test_codec_info_names_the_kernels_that_run():
    info = compcomm.codec_info()
    if _native.library_path() is None:
        assert info["cpu"].startswith("torch kernels: the C codec was not compiled")
    else:
        assert info["cpu"].startswith("native C kernels (")
    assert ("cuda" in info) == __import__("torch").cuda.is_available()


def test_switched_off_c_codec_is_named_and_silent(tmp_path):
    code = "import compcomm; print(compcomm.codec_info()['cpu'])"
    done = run([sys.executable, "-W", "error::RuntimeWarning", "-c", code], tmp_path, COMPCOMM_NATIVE="0")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "torch kernels (COMPCOMM_NATIVE=0)"


def test_missing_c_codec_warns_at_first_use_and_gives_the_same_bits(tmp_path):
    code = (
        "import warnings, torch, compcomm\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    t = torch.arange(-5.0, 6.0); compcomm.compressed_allreduce(t, compcomm.ErrorFeedback())\n"
        "    compcomm.compressed_allreduce(t, compcomm.ErrorFeedback())\n"
        "print(len(caught)); print(caught[0].message); print(t.tolist())"
    )
    done = run([sys.executable, "-c", code], tmp_path, PYTHONPATH=str(source_copy(tmp_path)), PYTHONNOUSERSITE="1")
    assert done.returncode == 0, done.stderr
    count, message, values = done.stdout.strip().split("\n")
    assert count == "1" and "the C codec was not compiled" in message and "slower" in message
    t = __import__("torch").arange(-5.0, 6.0)
    compcomm.compressed_allreduce(t, compcomm.ErrorFeedback())
    compcomm.compressed_allreduce(t, compcomm.ErrorFeedback())
    assert values == str(t.tolist())


def test_build_without_a_compiler_stops_unless_told_to_go_on(tmp_path):
    tree = tmp_path / "pkg"
    shutil.copytree(ROOT / "compcomm", tree / "compcomm", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    shutil.copy(ROOT / "setup.py", tree)
    build = [sys.executable, "setup.py", "-q", "build_ext", "--inplace"]
    failed = run(build, tree, CC="false", LDSHARED="false")
    assert failed.returncode != 0
    assert "the C codec could not be compiled" in failed.stderr and "COMPCOMM_ALLOW_NO_NATIVE=1" in failed.stderr
    allowed = run(build, tree, CC="false", LDSHARED="false", COMPCOMM_ALLOW_NO_NATIVE="1")
    assert allowed.returncode == 0, allowed.stderr
    assert "!" * 78 in allowed.stderr and "about 10x slower" in allowed.stderr
    assert not list(tree.glob("compcomm/_codec_native*"))

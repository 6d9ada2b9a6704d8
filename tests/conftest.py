import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
# Helpers shared by the test modules (`from rankpool import RankPool`, `from launched import ...`).
sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))


@pytest.fixture(scope="module")
def pool():
    """Four real gloo ranks, spawned once per test module."""
    from rankpool import RankPool

    ranks = RankPool(world_size=4)
    yield ranks
    ranks.close()

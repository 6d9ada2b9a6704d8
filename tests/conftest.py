import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="module")
def pool():
    """Four real gloo ranks, spawned once per test module."""
    from rankpool import RankPool

    ranks = RankPool(world_size=4)
    yield ranks
    ranks.close()

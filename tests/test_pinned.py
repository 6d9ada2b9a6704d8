"""The mpi backend's staging pool for CUDA tensors (an MPI that is not CUDA-aware): its reuse
logic, on buffers given back. Pinned allocation itself needs a GPU (tests/test_nccl.py)."""

from __future__ import annotations

import torch

from compcomm.backends.pinned import PinnedPool


def test_take_hands_back_the_smallest_free_buffer_that_fits():
    pool = PinnedPool()
    small, large, medium = (torch.zeros(n, dtype=torch.uint8) for n in (4096, 65536, 16384))
    for buf in (small, large, medium):
        pool.give(buf)
    assert pool.take(5000) is medium  # not compared with ==, which is elementwise for tensors
    assert pool.take(100) is small
    assert pool.take(20000) is large
    assert pool.free == [] and pool.allocated == 0

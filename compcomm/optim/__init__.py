"""1-bit optimizers built on compcomm.compressed_allreduce (SPEC section 6).

- `OnebitAdam`: 1-bit Adam (Tang et al. 2021), in `adam.py`.
- `OnebitLamb`: 1-bit LAMB (Li et al. 2021), in `lamb.py`.
- `OnebitOptimizer`: what both share (buckets, the two stages, NaN agreement, checkpoints), in `base.py`.
"""
from .adam import OnebitAdam
from .base import OnebitOptimizer
from .lamb import OnebitLamb

__all__ = ["OnebitAdam", "OnebitLamb", "OnebitOptimizer"]

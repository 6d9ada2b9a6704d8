"""1-bit optimizers built on compcomm.compressed_allreduce (SPEC section 6).

- `OnebitAdam`: 1-bit Adam (Tang et al. 2021), in `adam.py`.
- `OnebitLamb`: 1-bit LAMB (Li et al. 2021), in `lamb.py`.
- `OnebitOptimizer`: what both share (buckets, the two stages, NaN agreement, checkpoints), in `base.py`.

Choices where the papers/SPEC leave room:
- Adam/LAMB use torch's bias corrections and decoupled weight decay (warm-up = torch.optim.AdamW,
  = torch.optim.Adam at weight_decay=0); the frozen second moment keeps its correction of step
  freeze_step. freeze_step must be >= 1.
- Parameters with `.grad = None` count as zero gradients (every rank sends the same buckets).
- Checkpoints: a state dict from another world size raises ValueError;
  `OnebitOptimizer.drop_error_feedback(sd)` is the explicit way to resume with zeroed errors.
- Buckets: the class attribute `bucket_bytes` (25 MiB), settable on an instance before its first step.
"""
from .adam import OnebitAdam
from .base import OnebitOptimizer
from .lamb import OnebitLamb

__all__ = ["OnebitAdam", "OnebitLamb", "OnebitOptimizer"]

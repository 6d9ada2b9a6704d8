"""Compressed data-parallel optimizers built on compcomm.compressed_allreduce.

- `OnebitAdam`: 1-bit Adam (Tang et al. 2021), in `adam.py`.
- `OnebitLamb`: 1-bit LAMB (Li et al. 2021), in `lamb.py`.
- `ZeroOneAdam`: 0/1 Adam (Lu et al. 2022), in `zeroone.py`.
- `DiLoCo`: DiLoCo and Streaming DiLoCo (Douillard et al. 2023, 2025) around any torch inner
  optimizer, with 1-bit error-feedback pseudo-gradients, in `diloco.py`.
- `OnebitOptimizer`: what they share (buckets, overlap with backward, `no_sync`, NaN agreement,
  GradScaler support, checkpoints), in `base.py`.

Choices where the papers leave room:
- Adam/LAMB use torch's bias corrections and decoupled weight decay (warm-up = torch.optim.AdamW,
  = torch.optim.Adam at weight_decay=0); the frozen second moment keeps its correction of step
  freeze_step. freeze_step must be >= 1.
- Parameters with `.grad = None` count as zero gradients (every rank sends the same buckets);
  parameters with `requires_grad=False` are not updated at all (no weight decay), as in torch.
- bfloat16 parameters are updated through an fp32 master copy kept in the optimizer state.
- Masking: in a compressed update, elements whose bias-corrected sqrt(v) is at most eps (they
  got no real gradient while v was estimated) do not move with the communicated momentum;
  a parameter group's `exp_avg_mask` (1 keeps, 0 masks; broadcast to each parameter) masks more.
- Checkpoints: `state_dict()` belongs to its rank; loading another rank's or another world
  size's state raises ValueError on every rank. `gathered_state_dict()` (collective) makes one
  file for all ranks; `OnebitOptimizer.drop_error_feedback(sd)` is the explicit way to resume
  with zeroed errors on any world size.
- GradScaler: `scaler.step(opt)` works (torch's `_step_supports_amp_scaling` protocol): the
  ranks agree on the inf check at the end of backward, every rank skips alike, and the scale
  stays equal everywhere.
- Buckets: the class attribute `bucket_bytes` (25 MiB), settable on an instance before its first
  backward; `overlap` (True) starts each bucket's collective during backward.
"""

from .adam import OnebitAdam
from .base import OnebitOptimizer
from .diloco import DiLoCo
from .lamb import OnebitLamb
from .zeroone import ZeroOneAdam

__all__ = ["DiLoCo", "OnebitAdam", "OnebitLamb", "OnebitOptimizer", "ZeroOneAdam"]

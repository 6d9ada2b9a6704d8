"""Parameters laid out in fp32 communication buckets, each with its error feedback.

An optimizer that averages one value per parameter (a gradient, a momentum, a pseudo-gradient)
sends them through a few flat buffers instead of one collective per parameter. Each bucket owns
one ErrorFeedback, because the compressed allreduce carries errors per reduced tensor, and a
spare one: a step's call writes its new errors into the spare (`error_feedback_out`, no copy of
the kept state first), and the two swap roles only when the whole step succeeded, so a step
that fails in a later bucket leaves every bucket's state as it was.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..error_feedback import ErrorFeedback
from ..layout import Bucket, Bucketer


class BucketLayout:
    """`params` taken in `order` (parameter indices), grouped into fp32 buckets of at most
    `bucket_bytes`, padded for `world_size` ranks; `tag` names the buckets' error feedback."""

    def __init__(
        self, params: Sequence[torch.Tensor], order: Sequence[int], bucket_bytes: int, world_size: int, tag: str
    ) -> None:
        if not params:
            raise ValueError("the optimizer has no parameters")
        self.order = list(order)  # bucket slot -> parameter index
        self.bucketer = Bucketer([params[i] for i in self.order], bucket_bytes, world_size, dtype=torch.float32)
        self.bucket_of = {self.order[k]: b for b, bucket in enumerate(self.bucketer) for k in bucket.indices}
        # Steps write into the spare (its buffer takes the new x'), so a second buffer per
        # ErrorFeedback would only serve DiLoCo's rare syncs in place: not worth its memory.
        self.error_feedback = [
            ErrorFeedback(tag=f"{tag}.bucket{b}", double_buffer=False) for b in range(len(self.bucketer))
        ]
        self.spare = [ErrorFeedback(tag=ef.tag, double_buffer=False) for ef in self.error_feedback]

    def __len__(self) -> int:
        return len(self.bucketer)

    @property
    def buckets(self) -> list[Bucket]:
        return self.bucketer.buckets

    def parameters_of(self, b: int) -> list[int]:
        """The parameter indices of bucket b, in bucket order."""
        return [self.order[k] for k in self.bucketer.buckets[b].indices]

    def values(self, count: int) -> list[torch.Tensor]:
        """Each parameter's slot in the buckets (a flat view), in parameter order."""
        values: list[torch.Tensor] = [torch.empty(0)] * count
        for bucket in self.bucketer:
            for k, view in zip(bucket.indices, bucket.views):
                values[self.order[k]] = view
        return values

    def keep(self, b: int, errors: ErrorFeedback) -> None:
        """Bucket b's step succeeded everywhere: `errors` (its spare, which the step's call wrote)
        becomes its error feedback, and the old state becomes the spare."""
        self.error_feedback[b], self.spare[b] = errors, self.error_feedback[b]

    def sizes(self) -> list[int]:
        return [bucket.numel for bucket in self.bucketer]

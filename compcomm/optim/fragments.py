"""Streaming DiLoCo's schedule: the buckets cut into K fragments, synced at staggered steps.

Fragment f holds a contiguous run of buckets (cut so that the fragments' element counts are as
even as the buckets allow) and is sent after local step s when s % H == offset_f, with
offset_f = ((f + 1) H // K) mod H: the offsets are spread evenly over the H steps, and the last
fragment syncs at multiples of H, like plain DiLoCo (K = 1: every bucket at s = H, 2H, ...).
So each step sends at most one fragment, about 1/K of the model, instead of the whole model
every H steps. A fragment sent after step s is applied `overlap` steps later, after step
s + overlap (< s + H, so before the fragment is sent again).
"""

from __future__ import annotations

from collections.abc import Sequence


def partition(sizes: Sequence[int], parts: int) -> list[list[int]]:
    """Bucket indices 0..len(sizes)-1 cut into `parts` contiguous non-empty runs whose summed
    sizes are as close as the cuts allow to an even share (ValueError if there are fewer
    buckets than parts)."""
    if not 1 <= parts <= len(sizes):
        raise ValueError(
            f"fragments={parts} needs at least as many communication buckets, but the parameters "
            f"make {len(sizes)} (a bucket holds whole parameters): lower fragments, or pass a smaller bucket_bytes"
        )
    prefix = [0]
    for size in sizes:
        prefix.append(prefix[-1] + size)
    total, runs, start = prefix[-1], [], 0
    for f in range(parts):
        if f == parts - 1:
            stop = len(sizes)
        else:
            target = total * (f + 1) / parts
            candidates = range(start + 1, len(sizes) - (parts - 1 - f) + 1)
            stop = min(candidates, key=lambda c: abs(prefix[c] - target))
        runs.append(list(range(start, stop)))
        start = stop
    return runs


class FragmentSchedule:
    """Which buckets each fragment holds, and at which local steps it is sent and applied."""

    def __init__(self, bucket_sizes: Sequence[int], fragments: int, sync_every: int, overlap: int) -> None:
        self.buckets = partition(bucket_sizes, fragments)
        self.sync_every = sync_every
        self.overlap = overlap
        self.offsets = [((f + 1) * sync_every // fragments) % sync_every for f in range(fragments)]

    def __len__(self) -> int:
        return len(self.buckets)

    def sending(self, s: int) -> list[int]:
        """The fragments sent after local step s (s >= 1)."""
        return [f for f, offset in enumerate(self.offsets) if s >= 1 and s % self.sync_every == offset]

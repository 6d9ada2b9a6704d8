"""How much of a step's communication ran behind backward: the measure of the overlap.

The optimizers' collectives run one after another on their group's ordered channel, so a
bucket's collective occupies it from when it was submitted (or, if the one before was still
running, from when that one finished) until it completes. The part of that time before the
end of backward is hidden behind backward; the rest is what `step()` may have to wait for.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass(frozen=True)
class CommTiming:
    """One step's collectives: `busy` seconds on the channel, `hidden` of them before the end
    of backward (both include the collectives' own compute, e.g. the 1-bit codec)."""

    busy: float
    hidden: float

    @property
    def hidden_fraction(self) -> float:
        """hidden / busy (0 when nothing was sent)."""
        return self.hidden / self.busy if self.busy > 0 else 0.0


@dataclass
class CommClock:
    """Submission and completion times of one step's collectives, and the end of its backward."""

    submitted: list[float] = field(default_factory=list)
    completed: dict[int, float] = field(default_factory=dict)  # by submission index
    backward_end: float | None = None

    def submit(self) -> int:
        """Note a submission now; its index, for `complete`."""
        self.submitted.append(time.perf_counter())
        return len(self.submitted) - 1

    def complete(self, index: int) -> None:
        self.completed[index] = time.perf_counter()

    def backward_ended(self) -> None:
        self.backward_end = time.perf_counter()

    def timing(self) -> CommTiming:
        """The busy and hidden time of the collectives submitted so far, once all have been
        waited for (one whose completion callback has not run yet completed about now)."""
        now = time.perf_counter()
        busy = hidden = 0.0
        channel_free = float("-inf")
        end = self.backward_end if self.backward_end is not None else float("-inf")
        for i, submitted in enumerate(self.submitted):
            start, done = max(submitted, channel_free), self.completed.get(i, now)
            busy += max(0.0, done - start)
            hidden += max(0.0, min(done, end) - start)
            channel_free = max(channel_free, done)
        return CommTiming(busy, hidden)

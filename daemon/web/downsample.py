"""A (step, value) series held in a bounded number of buckets, so a chart of a 10M-step job costs what a chart of
a 1000-step job costs.

The steps are cut into aligned buckets of `width` consecutive steps (bucket k holds [k·width, (k+1)·width)); at
most `capacity` of them are kept. `width` starts at 1, so a short series is exact: every step its own bucket.
When one more bucket would be one too many, `width` doubles and neighbours merge pairwise (and again, until
they fit). Merging is exact: a bucket keeps its count and sum (the mean) and the step and value of its minimum
and of its maximum, so `points()` — min and max of each bucket, in step order — keeps every spike at its step,
and a series of up to about 2·capacity steps is still drawn exactly.

A step at or below the last one kept (a resumed run reporting again from its checkpoint) drops the buckets that
hold steps at or after it, so the last report of a step wins, as with one point per step; with buckets wider
than 1 that also drops the earlier steps sharing the resume point's bucket (at most width − 1 of them).
"""

from __future__ import annotations

import bisect


class Bucket:
    __slots__ = ("start", "n", "total", "lo_step", "lo", "hi_step", "hi", "last_step")

    def __init__(self, start: int, step: int, value: float):
        self.start, self.n, self.total = start, 1, value
        self.lo_step = self.hi_step = self.last_step = step
        self.lo = self.hi = value

    def take(self, step: int, value: float) -> None:
        self.n += 1
        self.total += value
        self.last_step = step
        if value < self.lo:
            self.lo_step, self.lo = step, value
        if value > self.hi:
            self.hi_step, self.hi = step, value

    def merge(self, later: Bucket) -> None:
        """Fold in the bucket after this one (its steps are all greater)."""
        self.n += later.n
        self.total += later.total
        self.last_step = later.last_step
        if later.lo < self.lo:
            self.lo_step, self.lo = later.lo_step, later.lo
        if later.hi > self.hi:
            self.hi_step, self.hi = later.hi_step, later.hi

    @property
    def mean(self) -> float:
        return self.total / self.n


class Downsampled:
    def __init__(self, capacity: int = 500):
        if capacity < 2:
            raise ValueError("capacity must be at least 2")
        self.capacity = capacity
        self.width = 1
        self.buckets: list[Bucket] = []  # ascending, non-empty ones only

    def add(self, step: int, value: float) -> None:
        """One report; `value` must be finite (a chart cannot place NaN or inf, so the caller leaves them out)."""
        b = self.buckets
        if b:
            last = b[-1]
            if step <= last.last_step:
                self.rewind(step)
            elif step - last.start < self.width:  # the common case: the next step, in the newest bucket
                last.take(step, value)
                return
        start = step - step % self.width
        if b and b[-1].start == start:
            b[-1].take(step, value)
            return
        b.append(Bucket(start, step, value))
        if len(b) > self.capacity:
            self._coarsen()

    def rewind(self, step: int) -> None:
        """Forget every bucket holding a step at or after `step`."""
        while self.buckets and self.buckets[-1].last_step >= step:
            self.buckets.pop()

    def _coarsen(self) -> None:
        while len(self.buckets) > self.capacity:
            self.width *= 2
            merged: list[Bucket] = []
            for bk in self.buckets:
                start = bk.start - bk.start % self.width
                if merged and merged[-1].start == start:
                    merged[-1].merge(bk)
                else:
                    bk.start = start
                    merged.append(bk)
            self.buckets = merged

    @property
    def count(self) -> int:
        """How many reports the buckets hold."""
        return sum(bk.n for bk in self.buckets)

    def points(self) -> list[tuple[int, float]]:
        """Each bucket's minimum and maximum at their own steps (one point when they are the same step), in step
        order: at most 2 · capacity points."""
        out: list[tuple[int, float]] = []
        for bk in self.buckets:
            if bk.lo_step == bk.hi_step:
                out.append((bk.lo_step, bk.lo))
            elif bk.lo_step < bk.hi_step:
                out += [(bk.lo_step, bk.lo), (bk.hi_step, bk.hi)]
            else:
                out += [(bk.hi_step, bk.hi), (bk.lo_step, bk.lo)]
        return out

    def means(self) -> list[tuple[int, float]]:
        """(first step, mean) of each bucket."""
        return [(bk.start, bk.mean) for bk in self.buckets]


def mean_near(means: list[tuple[int, float]], step: int) -> float | None:
    """The mean of the bucket that `step` falls in (from `means()`), or None when it falls before the first."""
    i = bisect.bisect_right(means, step, key=lambda m: m[0]) - 1
    return means[i][1] if i >= 0 else None

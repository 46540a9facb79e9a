"""Data order as a pure function of (seed, epoch, position).

Nothing here keeps state between calls: the sample at global position g is
`epoch_permutation(seed, g // n, n)[g % n]`. Resuming therefore needs only the
count of samples consumed, and a resumed run continues with exactly the next
sample, mid-epoch included.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np


@lru_cache(maxsize=4)
def epoch_permutation(seed: int, epoch: int, n: int) -> tuple[int, ...]:
    rng = np.random.Generator(np.random.PCG64([seed, epoch]))
    return tuple(int(i) for i in rng.permutation(n))


@dataclass(frozen=True)
class Cursor:
    """How many samples have been consumed; epoch and position follow from it."""

    consumed: int
    n: int

    @property
    def epoch(self) -> int:
        return self.consumed // self.n

    @property
    def position(self) -> int:
        return self.consumed % self.n


def sample_indices(seed: int, n: int, start: int, count: int) -> list[int]:
    """Dataset indices for global positions start .. start+count-1 (crossing epochs as needed)."""
    out = []
    for g in range(start, start + count):
        out.append(epoch_permutation(seed, g // n, n)[g % n])
    return out

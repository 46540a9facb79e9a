"""The aspect-ratio buckets of the image families (engine/data/images.py's docstring says how they are chosen).

Here, not in engine/data/, so that validating a job (an edit job's controls train at their target's bucket:
engine/config/controls.py) imports no data reader.
"""

from __future__ import annotations

import math

MAX_ASPECT = 2.0


def bucket_step(resolution: int) -> int:
    return 16 if resolution <= 256 else 64


def buckets_for(resolution: int) -> list[tuple[int, int]]:
    """Bucket sizes (w, h) around resolution² area, aspect ratio within 2:1, multiples of the step."""
    step = bucket_step(resolution)
    area = resolution * resolution
    out = set()
    for w in range(step, 2 * resolution + 1, step):
        h = (area // w) // step * step
        if h >= step and max(w / h, h / w) <= MAX_ASPECT:
            out.add((w, h))
    return sorted(out)


def assign_bucket(width: int, height: int, resolution: int) -> tuple[int, int]:
    target = math.log(width / height)
    return min(buckets_for(resolution), key=lambda b: (abs(math.log(b[0] / b[1]) - target), -b[0] * b[1]))

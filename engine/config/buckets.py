"""The aspect-ratio buckets of the image and video families (engine/data/images.py's docstring says how they are
chosen), each side a multiple of the family's spatial multiple.

Here, not in engine/data/, so that validating a job (an edit job's controls train at their target's bucket:
engine/config/controls.py) imports no data reader.
"""

from __future__ import annotations

import math

MAX_ASPECT = 2.0


def bucket_step(resolution: int, multiple: int = 16) -> int:
    """16 px up to resolution 256, 64 above, made a multiple of the family's spatial multiple (VAE factor × patch,
    engine/registry/facts.py): a side that is not one would give the transformer a latent it cannot patch."""
    return math.lcm(16 if resolution <= 256 else 64, multiple)


def buckets_for(resolution: int, multiple: int = 16) -> list[tuple[int, int]]:
    """Bucket sizes (w, h) around resolution² area, aspect ratio within 2:1, multiples of the step; none where
    the resolution is below the step (engine/config/rules.py refuses such a job at submit)."""
    step = bucket_step(resolution, multiple)
    area = resolution * resolution
    out = set()
    for w in range(step, 2 * resolution + 1, step):
        h = (area // w) // step * step
        if h >= step and max(w / h, h / w) <= MAX_ASPECT:
            out.add((w, h))
    return sorted(out)


def assign_bucket(width: int, height: int, resolution: int, multiple: int = 16) -> tuple[int, int]:
    target = math.log(width / height)
    return min(buckets_for(resolution, multiple), key=lambda b: (abs(math.log(b[0] / b[1]) - target), -b[0] * b[1]))

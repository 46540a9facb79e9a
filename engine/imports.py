"""The training stack's imports, made where no garbage collection walks them again.

torch, transformers, diffusers and peft make half a million objects on import and next to no garbage. With the
collector on, it walked them again and again as they grew (~0.85 s of a trainer's ~4.5 s of imports), and every
later full collection (one per encoder in the image cache, one at exit) walked them once more. Imported with the
collector off, then frozen out of its reach, they cost nothing after. One rule for the trainer, the launcher and
the daemon's warm trainer; imports nothing but the standard library, so it runs before the big imports.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def unwalked_imports() -> Iterator[None]:
    """Run the block's imports with the collector off, then freeze what exists and turn the collector back on."""
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()

"""An out-of-memory while the frozen base is put on the device, said so that the daemon can re-plan it.

Loading reads the base into host memory; then its FP8 layers are made on the device and the rest is placed
(engine/frozen_base/precision.py, blockswap.place_model), the swapped blocks' frozen weights staying on the host.
An out-of-memory there is a LoadOutOfMemory: it says how many blocks the model has and how many were swapped, so
that the daemon's re-plan swaps more and the next attempt loads again (a 24 GB base on a 24 GB card;
engine/memory_plan/attempt.py). One anywhere else in the load (a bitsandbytes quantisation on the GPU) names no
blocks, and the job fails with it.

$LORAD_DEBUG_OOM_AT_LOAD=N (tests only; unset in real runs): placing raises the real torch.OutOfMemoryError while
fewer than N blocks are swapped: a model that loads once the re-plan swaps N of its blocks.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn as nn

from engine.frozen_base.blockswap import find_blocks

OOM_AT_LOAD_ENV = "LORAD_DEBUG_OOM_AT_LOAD"


class LoadOutOfMemory(torch.OutOfMemoryError):
    """Out of memory while placing a model of `blocks` blocks with `swapped` of them left on the host."""

    def __init__(self, message: str, blocks: int, swapped: int):
        super().__init__(message)
        self.blocks, self.swapped = blocks, swapped

    def plan(self) -> dict | None:
        """The plan the load ran under, as MemoryPlan.report() says it (the fields the re-plan reads); None for a
        model without blocks, which has no lever."""
        if not self.blocks:
            return None
        return {"blocks": self.blocks, "swap": self.swapped,
                "summary": f"swap {self.swapped}/{self.blocks} blocks while loading"}


def debug_load_oom(swapped: int) -> None:
    """Raise torch.OutOfMemoryError while the base is placed with too few blocks swapped (module docstring)."""
    at = os.environ.get(OOM_AT_LOAD_ENV, "").strip()
    if at and swapped < int(at):
        raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate 1.00 GiB. (raised by {OOM_AT_LOAD_ENV}="
                                     f"{at} with {swapped} blocks swapped)")


@contextmanager
def placing(model: nn.Module, blocks_to_swap: int) -> Iterator[None]:
    """Around putting `model`'s frozen base on the device (FP8 layers made there, then place_model): an
    out-of-memory in it becomes a LoadOutOfMemory naming the model's blocks and the swap it was placed with."""
    try:
        debug_load_oom(blocks_to_swap)
        yield
    except torch.OutOfMemoryError as e:
        raise LoadOutOfMemory(str(e), len(find_blocks(model)), blocks_to_swap) from None

"""The bytes a memory plan may spend on the job's GPU, and where that figure came from.

In order, the first that is there:
    $LORAD_VRAM_BUDGET_GB    set by the daemon under `gpu_memory_policy: plan`: the VRAM it found free on the
                             GPU (other programs hold the rest); a float, GiB
    resources.vram_gb        the job's own figure (a card shared on purpose, a plan for a smaller card)
    the card's free memory   torch.cuda.mem_get_info on a CUDA device, read when the plan is made
    no limit                 the CPU (or anything else): the plan keeps the job's settings
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from engine.memory_plan.attempt import BUDGET_ENV

GIB = 1 << 30


@dataclass(frozen=True)
class Budget:
    bytes: int | None  # None: no limit
    source: str  # "LORAD_VRAM_BUDGET_GB", "resources.vram_gb", "free VRAM", "none"

    def gib(self) -> float | None:
        return None if self.bytes is None else round(self.bytes / GIB, 3)


def vram_budget(vram_gb: float | None, device: torch.device, env: dict[str, str] | None = None) -> Budget:
    """The budget for a job whose resources.vram_gb is `vram_gb`, training on `device` (see the module docstring)."""
    env = os.environ if env is None else env
    raw = (env.get(BUDGET_ENV) or "").strip()
    if raw:
        try:
            gb = float(raw)
        except ValueError:
            gb = -1.0
        if gb > 0 and gb == gb and gb != float("inf"):
            return Budget(int(gb * GIB), BUDGET_ENV)
        # A daemon never sets a bad value; a person might: said by the caller's plan summary, never fatal.
    if vram_gb is not None:
        return Budget(int(vram_gb * GIB), "resources.vram_gb")
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return Budget(int(free), "free VRAM")
    return Budget(None, "none")

"""Which devices trainers may use: one job per GPU; a CPU-only machine runs one job at a time.

Counted through NVML (nvidia-ml-py), never torch: initialising CUDA in the
daemon would tie GPU memory and driver faults to the service process.
"""

from __future__ import annotations

from typing import Union


def detect(configured: Union[str, list[int]]) -> list[int | None]:
    if isinstance(configured, list):
        return list(configured) or [None]
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            n = pynvml.nvmlDeviceGetCount()
        finally:
            pynvml.nvmlShutdown()
        return list(range(n)) if n > 0 else [None]
    except Exception:  # noqa: BLE001 — no driver, no library, no GPU: all mean "CPU"
        return [None]

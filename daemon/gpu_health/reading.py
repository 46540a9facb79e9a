"""One reading of one GPU, and what its parts mean.

Fatal Xids are the ones NVIDIA's Xid catalogue attributes to the hardware, the driver or the bus (a double-bit
ECC error, a row-remap failure, a GPU that fell off the bus, a GSP error, ...). Xids an application causes (13
graphics engine exception, 31 memory page fault, 43 stopped processing, 45 preemptive cleanup) kill that program,
not the GPU: they are logged and the GPU stays in service.
"""

from __future__ import annotations

from dataclasses import dataclass, field

GIB = float(1 << 30)

FATAL_XIDS = frozenset({
    48,  # double-bit ECC error
    61, 62,  # internal micro-controller breakpoint / halt
    63, 64,  # ECC page retirement or row remap recording failed
    74,  # NVLink error
    79,  # GPU has fallen off the bus
    92,  # high single-bit ECC error rate
    94, 95,  # contained / uncontained ECC error
    119, 120,  # GSP RPC timeout / GSP error
    140,  # unrecovered ECC error
})

# Clock-event reasons (daemon/power/telemetry.py names them) that mean the GPU slows itself down to protect itself,
# not because a cap asked for it.
THERMAL = ("sw_thermal_slowdown", "hw_thermal_slowdown")
HARDWARE = ("hw_slowdown", "hw_power_brake_slowdown")


@dataclass
class Reading:
    gpu: int
    lost: bool = False  # NVML_ERROR_GPU_IS_LOST: fell off the bus
    error: str | None = None  # any other NVML error reading it (NVML_ERROR_UNKNOWN, ...)
    xids: list[int] = field(default_factory=list)  # Xid critical-error events since the last reading
    ecc_uncorrected: int | None = None  # volatile uncorrectable ECC count (None: no ECC)
    pending_remap: bool = False  # remapped rows (or retired pages) pending: the GPU needs a reset
    remap_failed: bool = False
    throttle: list[str] = field(default_factory=list)
    memory_total: int | None = None  # bytes
    processes: list[tuple[int, int]] = field(default_factory=list)  # (pid, bytes) of compute processes on it


def slowdown(throttle: list[str]) -> list[str]:
    """"thermal" and/or "hardware" when the GPU is slowing itself down (a power cap is not a slowdown here)."""
    out = []
    if any(t in THERMAL for t in throttle):
        out.append("thermal")
    if any(t in HARDWARE for t in throttle):
        out.append("hardware")
    return out

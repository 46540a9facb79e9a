"""One reading of one GPU (daemon/power/gpu.py: HealthReading, made by NVML or the simulated device), and what its
parts mean.

Fatal Xids are the ones NVIDIA's Xid catalogue attributes to the hardware, the driver or the bus (a double-bit
ECC error, a row-remap failure, a GPU that fell off the bus, a GSP error, ...). Xids an application causes (13
graphics engine exception, 31 memory page fault, 43 stopped processing, 45 preemptive cleanup) kill that program,
not the GPU: they are logged and the GPU stays in service.
"""

from __future__ import annotations

from daemon.power.gpu import HealthReading as Reading  # noqa: F401 — the type lives with the devices that make it

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


def slowdown(throttle: list[str]) -> list[str]:
    """"thermal" and/or "hardware" when the GPU is slowing itself down (a power cap is not a slowdown here)."""
    out = []
    if any(t in THERMAL for t in throttle):
        out.append("thermal")
    if any(t in HARDWARE for t in throttle):
        out.append("hardware")
    return out

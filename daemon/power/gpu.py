"""What a power device reports and the one interface every device implements (NVML or the simulated model).

Both daemon/power/telemetry.py (NVML) and daemon/power/simulated.py build on
these types, so neither has to import the other for them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Protocol


class CapRefused(Exception):
    """The driver refused a power-limit change (not root, unsupported board, out of range)."""


@dataclass
class GpuInfo:
    index: int
    name: str
    min_w: float  # power-limit constraints
    max_w: float
    default_w: float
    simulated: bool = False


@dataclass
class Sample:
    ts: float  # wall clock, seconds since the epoch
    gpu: int
    power_w: float
    energy_mj: float  # monotonic total energy since the driver (or our integrator) started
    energy_source: str  # "counter" (NVML total-energy counter), "integrated" (power x time), "simulated"
    sm_mhz: float
    mem_mhz: float
    temp_c: float
    util_gpu: float
    util_mem: float
    limit_w: float  # the enforced limit
    throttle: list[str] = field(default_factory=list)  # clock-event reasons, decoded
    simulated: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class HealthReading:
    """One GPU health reading (daemon/gpu_health/ reads it): faults, throttle, the processes holding memory."""

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


class Device(Protocol):
    simulated: bool

    def count(self) -> int: ...
    def info(self, gpu: int) -> GpuInfo: ...
    def sample(self, gpu: int) -> Sample: ...
    def energy_mj(self, gpu: int) -> float: ...
    def limit_w(self, gpu: int) -> float: ...
    def set_limit_w(self, gpu: int, watts: float) -> None: ...
    def close(self) -> None: ...

"""The daemon config's `gpu_health:` section (daemon/gpu_health/); configs/daemon.yaml documents the same keys."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class GpuHealthSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # Readings come from where telemetry's do (power.telemetry.backend: nvml, simulated; off: none, no quarantine).
    enabled: bool = True
    interval_s: float = Field(1.0, ge=0.05, le=60.0)  # every GPU is read this often
    recover_s: float = Field(30.0, ge=0, le=86400)  # a quarantined GPU reading clean this long is taken back
    max_faults: int = Field(3, ge=1, le=1000)  # this many faults within fault_window_s: held until lorad gpu clear
    fault_window_s: float = Field(3600.0, gt=0)
    # gpu_memory_policy wait: a job waits while other programs hold more than this on every GPU it could use
    # (or, when the job names resources.vram_gb, until that much is free)
    foreign_vram_tolerance_gb: float = Field(0.5, ge=0, le=1024)

"""Daemon-config sections for power features (telemetry, caps, schedules, UPS). Filled in by the power work."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class PowerSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

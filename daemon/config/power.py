"""The daemon config's `power:` section (telemetry, caps, auto-tune, schedules, outages, UPS).

Every key has a default, so an empty or missing `power:` section is valid and
means: sample NVML telemetry if a driver is present, cap nothing, no schedule,
no UPS. configs/daemon.yaml documents the same keys for users.
"""

from __future__ import annotations

import re
from datetime import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

_HHMM = re.compile(r"^([01]\d|2[0-4]):([0-5]\d)$")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TelemetrySettings(_Strict):
    # nvml: the real driver ("telemetry unavailable" once if it is missing);
    # simulated: the documented model in daemon/power/simulated.py, labelled SIMULATED everywhere;
    # off: no sampler, no caps, no tuner.
    backend: Literal["nvml", "simulated", "off"] = "nvml"
    interval_s: float = Field(1.0, ge=0.05, le=60.0)  # sampling period per GPU
    raw_retention_s: int = Field(3600, ge=60)  # full-rate rows kept this long, then folded into minute rows
    history_days: float = Field(30.0, gt=0)  # minute rows kept this long
    simulated_gpus: int = Field(1, ge=1, le=16)  # how many devices the simulated backend pretends to have
    simulated_faults: str | None = None  # a JSON file of faults the simulated GPUs show (daemon/power/simulated.py)


class CapsSettings(_Strict):
    default_w: int | None = Field(None, ge=1, le=2000)  # daemon-wide cap on every GPU; None = leave the driver's limit
    restore_on_exit: bool = True  # put back the limit found at start-up when the daemon exits
    # A daemon that is not root sets limits through the power helper (systemd/lorad-power.service) on this socket
    helper_socket: str = "/run/lorad-power/lorad-power.sock"


class TunerSettings(_Strict):
    # Used by jobs whose `power.limit_w` is `auto`; the job's own `power.max_slowdown` is the bound.
    warmup_steps: int = Field(2, ge=0, le=100)  # steps after a limit change that are not measured (clocks settle)
    measure_steps: int = Field(3, ge=1, le=1000)  # measured steps per candidate limit
    max_candidates: int = Field(8, ge=2, le=64)  # candidate limits between the max and min constraint
    budget_fraction: float = Field(0.02, gt=0, le=0.5)  # profiling steps may use at most this share of the job
    round_w: int = Field(5, ge=1, le=100)  # candidate limits are rounded to this many watts


class Window(_Strict):
    """A weekly time window in the schedule's time zone: starts on `days` at `start`, ends at `end`
    (the next day when `end` <= `start`; "24:00" is midnight at the end of the day)."""

    days: str = "mon-sun"  # apscheduler cron day_of_week syntax: "mon-fri", "sat,sun", "*"
    start: str = "00:00"
    end: str = "24:00"

    @field_validator("start", "end")
    @classmethod
    def _hhmm(cls, v: str) -> str:
        m = _HHMM.match(v)
        if not m or (m.group(1) == "24" and m.group(2) != "00"):
            raise ValueError("must be HH:MM (00:00 to 24:00)")
        return v

    def start_time(self) -> time:
        h, m = map(int, self.start.split(":"))
        return time(h % 24, m)

    def end_time(self) -> time:
        h, m = map(int, self.end.split(":"))
        return time(h % 24, m)


class CapWindow(Window):
    limit_w: int = Field(ge=1, le=2000)  # cap on every GPU while this window is open


class ScheduleSettings(_Strict):
    timezone: str = "UTC"  # IANA name (zoneinfo): "Europe/Berlin"
    run_windows: list[Window] = Field(default_factory=list)  # empty = jobs may run at any time
    caps: list[CapWindow] = Field(default_factory=list)  # per-window caps; the lowest open one wins
    outages_file: str | None = None  # YAML list of planned outages, re-read when it changes
    lead_minutes: float = Field(10.0, ge=0, le=24 * 60)  # checkpoint and stop this long before an outage
    resume_after_minutes: float = Field(0.0, ge=0, le=24 * 60)  # wait this long after an outage ends

    @field_validator("timezone")
    @classmethod
    def _tz(cls, v: str) -> str:
        from zoneinfo import ZoneInfo

        try:
            ZoneInfo(v)
        except Exception as e:  # ZoneInfoNotFoundError, ValueError on odd names
            raise ValueError(f"unknown time zone {v!r}") from e
        return v


class UpsSettings(_Strict):
    enabled: bool = False
    host: str = "127.0.0.1"
    port: int = Field(3493, ge=1, le=65535)
    name: str = "ups"  # the UPS name in upsd.conf (`upsc ups@host`)
    poll_s: float = Field(5.0, ge=0.05, le=300)
    timeout_s: float = Field(3.0, gt=0, le=60)  # per request; a dead upsd never blocks the daemon longer
    on_battery: Literal["lowest_cap", "pause"] = "lowest_cap"  # after the immediate checkpoint
    resume_after_s: float = Field(60.0, ge=0, le=24 * 3600)  # OL held this long → restore caps, resume


class PowerSettings(_Strict):
    telemetry: TelemetrySettings = Field(default_factory=TelemetrySettings)
    caps: CapsSettings = Field(default_factory=CapsSettings)
    tuner: TunerSettings = Field(default_factory=TunerSettings)
    schedule: ScheduleSettings = Field(default_factory=ScheduleSettings)
    ups: UpsSettings = Field(default_factory=UpsSettings)

    @model_validator(mode="after")
    def _windows_parse(self):
        # Fail at config load, not at 3 a.m.: every cron day expression must be one apscheduler accepts.
        from apscheduler.triggers.cron import CronTrigger

        for w in [*self.schedule.run_windows, *self.schedule.caps]:
            try:
                CronTrigger(day_of_week=w.days, hour=0, minute=0, timezone=self.schedule.timezone)
            except ValueError as e:
                raise ValueError(f"schedule window days {w.days!r}: {e}") from e
        return self

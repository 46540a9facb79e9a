"""Run windows, per-window caps and the outage timetable, driven by a controllable clock."""

from __future__ import annotations

import os
from datetime import datetime, timedelta
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest
from pydantic import ValidationError

from daemon.config.power import PowerSettings, ScheduleSettings
from daemon.power import simulated as sim
from daemon.power.policy import PowerPolicy
from daemon.power.run_policy import RunningJob
from daemon.power.schedule import Schedule
from daemon.power.simulated import SimulatedDevice
from tests.helpers.fakes import RecLog

BERLIN = ZoneInfo("Europe/Berlin")


def at(s: str) -> datetime:
    return datetime.fromisoformat(s).replace(tzinfo=BERLIN)


def night_only() -> ScheduleSettings:
    # weeknights 22:00-07:00 (crossing midnight), whole weekend days; a 250 W cap on weekday daytime
    return ScheduleSettings(
        timezone="Europe/Berlin",
        run_windows=[{"days": "mon-fri", "start": "22:00", "end": "07:00"},
                     {"days": "sat,sun", "start": "00:00", "end": "24:00"}],
        caps=[{"days": "mon-fri", "start": "08:00", "end": "20:00", "limit_w": 250}],
    )


@pytest.mark.parametrize("when,open_", [
    ("2026-11-23 21:59", False),  # Monday evening
    ("2026-11-23 22:00", True),
    ("2026-11-24 03:00", True),  # Tuesday night, inside Monday's window
    ("2026-11-24 06:59", True),
    ("2026-11-24 07:00", False),
    ("2026-11-28 12:00", True),  # Saturday
    ("2026-11-28 00:00", True),  # Saturday starts (and Friday's window is still open)
    ("2026-11-30 06:00", False),  # Monday early: no window began Sunday 22:00 (days name the start day)
])
def test_run_windows_in_the_configured_time_zone(when, open_):
    assert Schedule(night_only(), RecLog()).state(at(when)).may_run is open_, when


def test_the_same_instant_in_utc_gives_the_same_answer():
    s = Schedule(night_only(), RecLog())
    t = at("2026-11-23 22:30")
    assert s.state(t).may_run == s.state(t.astimezone(ZoneInfo("UTC"))).may_run is True


def test_window_across_a_dst_change_ends_at_local_time():
    # 2026-03-29 clocks go 02:00 -> 03:00 in Berlin; a 22:00-07:00 window still ends at 07:00 local
    s = Schedule(ScheduleSettings(timezone="Europe/Berlin", run_windows=[{"days": "*", "start": "22:00", "end": "07:00"}]),
                 RecLog())
    assert s.state(at("2026-03-29 06:59")).may_run
    assert not s.state(at("2026-03-29 07:00")).may_run


def test_cap_windows_give_the_lowest_open_cap():
    s = Schedule(night_only(), RecLog())
    assert s.state(at("2026-11-24 12:00")).cap_w == 250
    assert s.state(at("2026-11-24 21:00")).cap_w is None


def _write(p: Path, text: str, bump: int) -> None:
    p.write_text(text)
    st = p.stat()
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns + bump * 1_000_000_000))  # a distinct mtime per edit


def test_outage_timetable_stops_lead_minutes_before_and_resumes_after_and_reloads_on_change(tmp_path: Path):
    f = tmp_path / "outages.yaml"
    _write(f, "outages:\n  - {start: '2026-11-24 14:00', end: '2026-11-24 16:00', note: grid work}\n", 1)
    log = RecLog()
    s = Schedule(ScheduleSettings(timezone="Europe/Berlin", outages_file=str(f), lead_minutes=10), log)
    assert s.state(at("2026-11-24 13:49")).may_run
    st = s.state(at("2026-11-24 13:50"))
    assert not st.may_run and "planned outage" in st.reason and "grid work" in st.reason
    assert not s.state(at("2026-11-24 15:59")).may_run
    assert s.state(at("2026-11-24 16:00")).may_run

    # a new entry is picked up without a restart
    _write(f, "outages:\n  - {start: '2026-11-24 18:00', end: '2026-11-24 19:00'}\n", 2)
    assert not s.state(at("2026-11-24 17:55")).may_run
    assert s.state(at("2026-11-24 14:30")).may_run  # the old entry is gone

    # a broken edit keeps the last good timetable and says so
    _write(f, "outages: [ {start: nonsense", 3)
    assert not s.state(at("2026-11-24 17:55")).may_run
    assert log.named("outage file invalid; keeping the previous timetable")


def test_policy_stops_and_resumes_a_job_at_window_and_outage_edges(tmp_path: Path):
    f = tmp_path / "outages.yaml"
    _write(f, "- {start: '2026-11-25 02:00', end: '2026-11-25 03:00'}\n", 1)
    settings = PowerSettings(schedule=night_only().model_copy(update={"outages_file": str(f), "lead_minutes": 15}))
    dev = SimulatedDevice(1)
    pol = PowerPolicy(settings, tmp_path, tmp_path / "state.db", RecLog(), device=dev, start_threads=False)
    job = RunningJob(job_id="j1", name="j1", pid=1, gpu=0, started_at=0.0, total=100)

    # walk Tuesday 2026-11-24 21:00 → Wednesday 08:00 in one-minute ticks, as the supervisor would
    running: list[RunningJob] = []
    stops, starts = [], []
    t = at("2026-11-24 21:00")
    while t <= at("2026-11-25 08:00"):
        d = pol.tick(t, running)
        if d.stop_running and running:
            stops.append((t.strftime("%H:%M"), d.stop_running))
            running = []  # SIGTERM → checkpoint → exit 75 → requeued
            pol.on_job_end("j1", 75)
        elif d.may_start and not running:
            starts.append(t.strftime("%H:%M"))
            running = [job]
            pol.on_job_start(job)
        t += timedelta(minutes=1)
    assert starts == ["22:00", "03:00"]
    assert [s for s, _ in stops] == ["01:45", "07:00"]
    assert "planned outage" in stops[0][1] and stops[1][1] == "outside run windows"

    # the daytime cap window holds the GPU at 250 W and lets go in the evening
    pol.tick(at("2026-11-25 12:00"), [])
    assert dev.limit_w(0) == 250
    pol.tick(at("2026-11-25 20:00"), [])
    assert dev.limit_w(0) == sim.DEFAULT_W
    pol.close()


def test_bad_schedule_settings_are_rejected_with_the_key():
    with pytest.raises(ValidationError, match="time zone"):
        ScheduleSettings(timezone="Mars/Olympus")
    with pytest.raises(ValidationError, match="HH:MM"):
        ScheduleSettings(run_windows=[{"start": "25:00"}])
    with pytest.raises(ValidationError, match="days"):
        PowerSettings(schedule={"run_windows": [{"days": "someday"}]})
    with pytest.raises(ValidationError, match="extra"):
        PowerSettings(ups={"hots": "x"})

"""Run windows, per-window caps and planned outages, as a pure function of the time.

Windows are apscheduler CronTriggers (day-of-week syntax, time-zone aware
through zoneinfo, DST handled by the trigger). Rather than running a
scheduler thread that fires "open"/"close" callbacks — which misses the
transition if the daemon was down at that moment — `state(now)` asks the
triggers whether `now` lies inside a window. The supervisor's tick passes
`now`, so tests drive it with any clock and a restart mid-window is correct.

The outage timetable is a YAML file, re-read when its mtime/size/inode
changes (checked on each tick — one stat — which also catches editors that
replace the file rather than write it):

    outages:
      - start: 2026-11-23 14:00      # naive times are in the schedule's time zone
        end: 2026-11-23 18:30
        note: grid maintenance
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import date, datetime, timedelta
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import yaml
from apscheduler.triggers.cron import CronTrigger

from daemon.config.power import ScheduleSettings, Window


@dataclass
class Outage:
    start: datetime
    end: datetime
    note: str = ""


@dataclass
class ScheduleState:
    may_run: bool = True  # False: stop running jobs (checkpoint, exit 75) and start none
    reason: str | None = None
    cap_w: float | None = None  # lowest cap of the open cap windows
    notes: list[str] = field(default_factory=list)


class _OpenWindow:
    def __init__(self, w: Window, tz: ZoneInfo):
        self.w, self.tz = w, tz
        st = w.start_time()
        self.trigger = CronTrigger(day_of_week=w.days, hour=st.hour, minute=st.minute, timezone=tz)
        # "end <= start" (22:00-07:00, 00:00-24:00) means the window ends on the following day.
        self.overnight = w.end == "24:00" or w.end_time() <= st

    def end_of(self, began: datetime) -> datetime:
        d: date = began.astimezone(self.tz).date() + timedelta(days=1 if self.overnight else 0)
        return datetime.combine(d, self.w.end_time(), tzinfo=self.tz)

    def open_until(self, now: datetime) -> datetime | None:
        """When the window containing `now` closes, or None if `now` is outside every occurrence."""
        t = now - timedelta(days=8)  # a window lasts at most a day; 8 days covers any weekly pattern
        while True:
            began = self.trigger.get_next_fire_time(None, t)
            if began is None or began > now:
                return None
            end = self.end_of(began)
            if now < end:
                return end
            t = began + timedelta(seconds=1)

    def next_open(self, now: datetime) -> datetime | None:
        return self.trigger.get_next_fire_time(None, now)


def parse_outages(text: str, tz: ZoneInfo) -> list[Outage]:
    doc = yaml.safe_load(text) or []
    items = doc.get("outages", []) if isinstance(doc, dict) else doc
    if not isinstance(items, list):
        raise ValueError("expected a list of outages (or a mapping with key 'outages')")
    out = []
    for i, it in enumerate(items):
        if not isinstance(it, dict) or "start" not in it or "end" not in it:
            raise ValueError(f"outage #{i + 1}: needs 'start' and 'end'")
        unknown = set(it) - {"start", "end", "note"}
        if unknown:
            raise ValueError(f"outage #{i + 1}: unknown key(s) {sorted(unknown)}")
        s, e = (_as_dt(it[k], tz, f"outage #{i + 1}.{k}") for k in ("start", "end"))
        if e <= s:
            raise ValueError(f"outage #{i + 1}: end must be after start")
        out.append(Outage(s, e, str(it.get("note") or "")))
    return out


def _as_dt(v: Any, tz: ZoneInfo, where: str) -> datetime:
    if isinstance(v, datetime):
        dt = v
    elif isinstance(v, str):
        try:
            dt = datetime.fromisoformat(v)
        except ValueError as e:
            raise ValueError(f"{where}: {v!r} is not a date-time (YYYY-MM-DD HH:MM)") from e
    else:
        raise ValueError(f"{where}: {v!r} is not a date-time")
    return dt.replace(tzinfo=tz) if dt.tzinfo is None else dt


class Schedule:
    def __init__(self, settings: ScheduleSettings, log: Any):
        self.s, self.log = settings, log
        self.tz = ZoneInfo(settings.timezone)
        self.windows = [_OpenWindow(w, self.tz) for w in settings.run_windows]
        self.caps = [(_OpenWindow(w, self.tz), float(w.limit_w)) for w in settings.caps]
        self.outages: list[Outage] = []
        self._file_sig: tuple | None = None
        self._said: set[str] = set()

    def _say_once(self, key: str, event: str, **kw: Any) -> None:
        if key not in self._said:
            self._said.add(key)
            self.log.warning(event, **kw)

    def reload_outages(self) -> None:
        """Re-read the outage file if it changed; a broken file keeps the last good timetable."""
        if not self.s.outages_file:
            return
        p = Path(self.s.outages_file)
        try:
            st = os.stat(p)
        except FileNotFoundError:
            if self._file_sig != "missing":
                self._file_sig = "missing"
                self.outages = []
                self._say_once(f"missing:{p}", "outage file not found; no planned outages", path=str(p))
            return
        sig = (st.st_mtime_ns, st.st_size, st.st_ino)
        if sig == self._file_sig:
            return
        self._file_sig = sig
        try:
            self.outages = parse_outages(p.read_text(), self.tz)
        except (OSError, ValueError, yaml.YAMLError) as e:
            self.log.warning("outage file invalid; keeping the previous timetable", path=str(p), error=str(e))
            return
        self._said.discard(f"missing:{p}")
        self.log.info("outage timetable loaded", path=str(p), outages=len(self.outages))

    def state(self, now: datetime) -> ScheduleState:
        if now.tzinfo is None:
            raise ValueError("schedule needs an aware datetime")
        self.reload_outages()
        st = ScheduleState()
        lead = timedelta(minutes=self.s.lead_minutes)
        after = timedelta(minutes=self.s.resume_after_minutes)
        for o in self.outages:
            if o.start - lead <= now < o.end + after:
                st.may_run = False
                when = o.start.astimezone(self.tz).strftime("%Y-%m-%d %H:%M %Z")
                st.reason = f"planned outage at {when}" + (f" ({o.note})" if o.note else "")
                st.notes.append(st.reason + f"; resuming after {(o.end + after).astimezone(self.tz):%H:%M}")
                break
        if st.may_run and self.windows:
            ends = [e for e in (w.open_until(now) for w in self.windows) if e is not None]
            if not ends:
                nxt = [n for n in (w.next_open(now) for w in self.windows) if n is not None]
                st.may_run = False
                st.reason = "outside run windows"
                if nxt:
                    st.notes.append(f"outside run windows; next opens {min(nxt).astimezone(self.tz):%a %H:%M %Z}")
        caps = [w for cw, w in self.caps if cw.open_until(now) is not None]
        if caps:
            st.cap_w = min(caps)
            st.notes.append(f"schedule cap {st.cap_w:.0f} W")
        return st

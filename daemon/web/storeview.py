"""What the dashboard and /metrics read: state.db on a read-only connection, and each job's events.jsonl.

The daemon stays the only writer: this connection is opened with mode=ro, so
no page can change the store (actions go through the socket handlers). A
trainer's events.jsonl is read incrementally: each job keeps the byte offset
it has parsed up to, and a page view reads only what was appended since.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from daemon.system.file_tail import tail_lines
from engine.report.events import decode_lines

EVENTS_TAIL_BYTES = 64 * 1024
MAX_SERIES_JOBS = 64  # parsed step series kept in memory (least recently used dropped)


def _ts(v: Any) -> float | None:
    """An event's `ts` (ISO 8601 from structlog) as epoch seconds."""
    if isinstance(v, (int, float)):
        return float(v)
    try:
        return datetime.fromisoformat(str(v).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


@dataclass
class Series:
    """A job's history as its trainer reported it: one point per step (the last report of a step wins, so a
    resumed run's curve shows the steps that survived), plus checkpoints and sample images."""

    offset: int = 0
    inode: int | None = None
    steps: dict[int, dict[str, Any]] = field(default_factory=dict)
    val: dict[int, float] = field(default_factory=dict)
    checkpoints: dict[int, dict[str, Any]] = field(default_factory=dict)
    samples: dict[int, dict[str, Any]] = field(default_factory=dict)
    last_checkpoint_ts: float | None = None
    used: float = 0.0
    _order: list[int] = field(default_factory=list)  # steps sorted, rebuilt only when new steps came

    def sorted_steps(self) -> list[int]:
        if len(self._order) != len(self.steps):
            self._order = sorted(self.steps)
        return self._order

    def add(self, ev: dict[str, Any]) -> None:
        kind = ev.get("event")
        if kind == "step" and isinstance(ev.get("step"), int):
            self.steps[ev["step"]] = {"ts": _ts(ev.get("ts")), "loss": ev.get("loss"), "lr": ev.get("lr"),
                                      "s_per_step": ev.get("s_per_step")}
            # A validation loss carried on a step line (the engine sends `validation` events, below).
            if isinstance(ev.get("val_loss"), (int, float)):
                self.val[ev["step"]] = float(ev["val_loss"])
        elif kind in ("eval", "validation") and isinstance(ev.get("step"), int) and \
                isinstance(ev.get("val_loss", ev.get("loss")), (int, float)):
            self.val[ev["step"]] = float(ev.get("val_loss", ev.get("loss")))
        elif kind == "checkpoint_committed" and isinstance(ev.get("step"), int):
            ts = _ts(ev.get("ts"))
            self.checkpoints[ev["step"]] = {"step": ev["step"], "ts": ts, "path": ev.get("path"),
                                            "seconds": ev.get("seconds")}
            if ts is not None:
                self.last_checkpoint_ts = max(self.last_checkpoint_ts or 0.0, ts)
        elif kind == "samples" and isinstance(ev.get("step"), int):
            self.samples[ev["step"]] = {"paths": list(ev.get("paths") or []), "prompts": list(ev.get("prompts") or [])}


class StoreView:
    def __init__(self, db_path: Path):
        self.db_path = Path(db_path)
        self._lock = threading.Lock()
        self._db: sqlite3.Connection | None = None
        self._series: dict[str, Series] = {}
        self._series_lock = threading.Lock()

    # ---------------------------------------------------------------- connection
    def _conn(self) -> sqlite3.Connection:
        if self._db is None:
            self._db = sqlite3.connect(f"file:{self.db_path}?mode=ro", uri=True, check_same_thread=False,
                                       timeout=5.0)
            self._db.row_factory = sqlite3.Row
        return self._db

    def query(self, sql: str, args: tuple = ()) -> list[dict[str, Any]]:
        with self._lock:
            try:
                return [dict(r) for r in self._conn().execute(sql, args).fetchall()]
            except sqlite3.OperationalError as e:
                if "no such table" in str(e):
                    return []  # e.g. the power tables of a daemon whose power features never started
                raise

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None

    # ---------------------------------------------------------------- jobs
    def jobs(self) -> list[dict[str, Any]]:
        """Every job, newest first, with its energy figures (avg W, J/step, kWh) where any were measured."""
        rows = self.query("SELECT id, name, state, priority, seq, submitted_at, updated_at, step, total, loss, "
                          "s_per_step, eta_s, requested, last_error, gpu, checkpoint_step FROM jobs ORDER BY seq DESC")
        energy = {r["job_id"]: r for r in self.query("SELECT job_id, energy_j, active_s, steps FROM power_jobs")}
        for r in rows:
            r.update(energy_figures(energy.get(r["id"])))
        return rows

    def job(self, job_id: str) -> dict[str, Any] | None:
        rows = self.query("SELECT * FROM jobs WHERE id=?", (job_id,))
        if not rows:
            return None
        job = rows[0]
        energy = self.query("SELECT job_id, energy_j, active_s, steps FROM power_jobs WHERE job_id=?", (job_id,))
        job.update(energy_figures(energy[0] if energy else None))
        return job

    def attempts(self, job_id: str) -> list[dict[str, Any]]:
        return self.query("SELECT * FROM attempts WHERE job_id=? ORDER BY n", (job_id,))

    def store_events(self, job_id: str, limit: int = 30) -> list[dict[str, Any]]:
        rows = self.query("SELECT id, ts, kind, data FROM events WHERE job_id=? ORDER BY id DESC LIMIT ?",
                          (job_id, limit))
        for r in rows:
            try:
                r["data"] = json.loads(r["data"])
            except ValueError:
                r["data"] = {}
        return rows[::-1]

    def job_power_samples(self, job_id: str) -> list[tuple[float, float]]:
        """(ts, W) of every telemetry row recorded while this job held its GPU, oldest first."""
        rows = self.query("SELECT ts, power_w FROM power_samples WHERE job_id=? AND power_w IS NOT NULL ORDER BY ts",
                          (job_id,))
        return [(r["ts"], r["power_w"]) for r in rows]

    def gpu_samples(self, since: float, bucket_s: float | None = None) -> list[dict[str, Any]]:
        """Telemetry since `since`, oldest first; with bucket_s, averaged per GPU over buckets that long
        (a chart 640 px wide gains nothing from 3600 points an hour)."""
        if bucket_s is None:
            return self.query("SELECT ts, gpu, power_w, limit_w, sm_mhz, mem_mhz, temp_c, util_gpu, throttle, "
                              "simulated FROM power_samples WHERE ts >= ? ORDER BY ts", (since,))
        return self.query("SELECT MIN(ts) AS ts, gpu, AVG(power_w) AS power_w, MIN(limit_w) AS limit_w, "
                          "AVG(sm_mhz) AS sm_mhz, AVG(mem_mhz) AS mem_mhz, MAX(temp_c) AS temp_c, "
                          "AVG(util_gpu) AS util_gpu, MAX(simulated) AS simulated FROM power_samples "
                          "WHERE ts >= ? GROUP BY gpu, CAST(ts / ? AS INTEGER) ORDER BY ts", (since, bucket_s))

    def throttle_counts(self, since: float) -> dict[int, dict[str, int]]:
        """Per GPU, how many samples since `since` named each throttle reason."""
        out: dict[int, dict[str, int]] = {}
        for r in self.query("SELECT gpu, throttle, COUNT(*) AS n FROM power_samples WHERE ts >= ? AND throttle != '' "
                            "GROUP BY gpu, throttle", (since,)):
            for why in filter(None, (r["throttle"] or "").split(",")):
                mine = out.setdefault(r["gpu"], {})
                mine[why] = mine.get(why, 0) + r["n"]
        return out

    def latest_gpu_samples(self, within_s: float = 120.0) -> dict[int, dict[str, Any]]:
        out: dict[int, dict[str, Any]] = {}
        for r in self.gpu_samples(time.time() - within_s):
            out[r["gpu"]] = r  # ordered by ts: the last one wins
        return out

    def state_counts(self) -> dict[str, int]:
        return {r["state"]: r["n"] for r in self.query("SELECT state, COUNT(*) AS n FROM jobs GROUP BY state")}

    def energy_all(self) -> dict[str, dict[str, Any]]:
        return {r["job_id"]: energy_figures(r) for r in
                self.query("SELECT job_id, energy_j, active_s, steps FROM power_jobs")}

    # ---------------------------------------------------------------- the trainer's events.jsonl
    def series(self, job_id: str, workdir: Path) -> Series:
        """The job's step history, brought up to date by reading only what was appended since the last call."""
        with self._series_lock:
            s = self._series.get(job_id)
            if s is None:
                s = self._series[job_id] = Series()
                if len(self._series) > MAX_SERIES_JOBS:
                    oldest = min(self._series, key=lambda k: self._series[k].used)
                    del self._series[oldest]
            s.used = time.monotonic()
            path = Path(workdir) / "events.jsonl"
            try:
                f = open(path, "rb")
            except OSError:
                return s
            with f:
                st = os.fstat(f.fileno())
                if st.st_ino != s.inode or st.st_size < s.offset:  # a new or truncated file: start again
                    self._series[job_id] = s = Series(inode=st.st_ino, used=s.used)
                f.seek(s.offset)
                data = f.read(st.st_size - s.offset)
            cut = data.rfind(b"\n") + 1  # whole lines only; a line being written is read next time
            for ev in decode_lines(data[:cut]):
                if isinstance(ev, dict):
                    s.add(ev)
            s.offset += cut
            return s

    def warm(self, jobs: list[tuple[str, Path]]) -> None:
        """Read these jobs' histories now (the daemon calls it on a thread at start), so that the first view of
        a long-running job's page does not pay for parsing its whole events.jsonl."""
        for job_id, workdir in jobs:
            self.series(job_id, workdir)

    @staticmethod
    def events_tail(workdir: Path, lines: int = 40) -> list[dict[str, Any]]:
        """The last lines of the job's events.jsonl (read from its end: cheap however long the log is)."""
        out = []
        for ln in (tail_lines(Path(workdir) / "events.jsonl", EVENTS_TAIL_BYTES) or [])[-lines:]:
            if not ln.strip():
                continue
            try:
                ev = json.loads(ln)
                out.append(ev if isinstance(ev, dict) else {"event": "unparsed", "text": str(ev)})
            except ValueError:
                out.append({"event": "unparsed", "text": ln.decode(errors="replace")})
        return out


def energy_figures(row: dict[str, Any] | None) -> dict[str, Any]:
    """Average W, J/step and kWh of a power_jobs row (all None when nothing was measured)."""
    if not row:
        return {"avg_w": None, "j_per_step": None, "kwh": None}
    e, s, n = row["energy_j"] or 0.0, row["active_s"] or 0.0, row["steps"] or 0
    return {"avg_w": e / s if s > 0 else None, "j_per_step": e / n if n > 0 else None, "kwh": e / 3.6e6}

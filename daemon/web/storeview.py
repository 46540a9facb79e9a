"""What the dashboard and /metrics read: state.db on a read-only connection, and each job's events.jsonl.

The daemon stays the only writer: this connection is opened with mode=ro, so
no page can change the store (actions go through the socket handlers). A
trainer's events.jsonl is read incrementally into a bounded, downsampled
history (daemon/web/history.py): a page view reads at most PAGE_READ_BYTES of
what was appended since, and a longer backlog is read on a thread.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

from daemon.web.history import History, Series, open_events

__all__ = ["History", "Series", "StoreView", "energy_figures"]

EVENTS_TAIL_BYTES = 64 * 1024
MAX_SERIES_JOBS = 64  # job histories kept in memory (least recently used dropped); each is bounded (history.py)
PAGE_READ_BYTES = 1 << 20  # a page reads at most this much of a job's new events (~5000 step lines) itself
CATCH_UP_BYTES = 1 << 20  # a backlog is read on a thread this much at a time, the lock freed in between


class StoreView:
    def __init__(self, db_path: Path):
        self.db_path = Path(db_path)
        self._lock = threading.Lock()
        self._db: sqlite3.Connection | None = None
        self._series: dict[str, Series] = {}
        self._series_lock = threading.Lock()
        self._catching: set[str] = set()  # jobs whose backlog a thread is reading

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

    def job_power_samples(self, job_id: str, since: float, until: float, bucket_s: float) -> list[tuple[float, float]]:
        """(ts, W) of the telemetry recorded while this job held its GPU between `since` and `until`, averaged over
        spans of bucket_s, oldest first."""
        rows = self.query("SELECT AVG(ts) AS ts, AVG(power_w) AS power_w FROM power_samples WHERE job_id=? AND "
                          "power_w IS NOT NULL AND ts BETWEEN ? AND ? GROUP BY CAST(ts / ? AS INTEGER) ORDER BY 1",
                          (job_id, since, until, bucket_s))
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

    def meta_json(self, key: str, default: Any) -> Any:
        """A meta value the daemon keeps as JSON (gpu_health, gpu_notes: daemon/supervisor/gpu_path.py)."""
        rows = self.query("SELECT value FROM meta WHERE key=?", (key,))
        try:
            return json.loads(rows[0]["value"]) if rows else default
        except ValueError:
            return default

    def state_counts(self) -> dict[str, int]:
        return {r["state"]: r["n"] for r in self.query("SELECT state, COUNT(*) AS n FROM jobs GROUP BY state")}

    def energy_all(self) -> dict[str, dict[str, Any]]:
        return {r["job_id"]: energy_figures(r) for r in
                self.query("SELECT job_id, energy_j, active_s, steps FROM power_jobs")}

    # ---------------------------------------------------------------- the trainer's events.jsonl
    def series(self, job_id: str, workdir: Path, most_bytes: int | None = None) -> History:
        """The job's history, brought up to date by reading at most `most_bytes` (PAGE_READ_BYTES) of what was
        appended since the last call; a longer backlog goes on being read on a thread (History.behind says how
        much is left)."""
        snap = self._read(job_id, Path(workdir), PAGE_READ_BYTES if most_bytes is None else most_bytes)
        if snap.behind:
            with self._series_lock:
                if job_id in self._catching:
                    return snap
                self._catching.add(job_id)
            threading.Thread(target=self._catch_up, args=(job_id, Path(workdir)), name="web-history",
                             daemon=True).start()
        return snap

    def _read(self, job_id: str, workdir: Path, most_bytes: int) -> History:
        with self._series_lock:
            s = self._series.get(job_id)
            if s is None:
                s = self._series[job_id] = Series()
                if len(self._series) > MAX_SERIES_JOBS:
                    oldest = min(self._series, key=lambda k: self._series[k].used)
                    del self._series[oldest]
            s.used = time.monotonic()
        with s.lock:
            s.catch_up(workdir, most_bytes)
            return s.snapshot()

    def _catch_up(self, job_id: str, workdir: Path) -> None:
        """Read the rest of a job's backlog, a chunk at a time: a page opened meanwhile waits for one chunk at
        most, and shows what has been read so far."""
        try:
            read, snap = -1, self._read(job_id, workdir, CATCH_UP_BYTES)
            while snap.behind and snap.read != read:  # and stop if a read made no progress (an I/O error)
                read, snap = snap.read, self._read(job_id, workdir, CATCH_UP_BYTES)
        finally:
            with self._series_lock:
                self._catching.discard(job_id)

    def warm(self, jobs: list[tuple[str, Path]]) -> None:
        """Read these jobs' histories now (the daemon calls it on a thread at start), so that the first view of
        a long-running job's page finds it read."""
        for job_id, workdir in jobs:
            with self._series_lock:
                self._catching.add(job_id)  # a page opened meanwhile starts no second reader
            self._catch_up(job_id, Path(workdir))

    @staticmethod
    def events_tail(workdir: Path, lines: int = 40) -> list[dict[str, Any]]:
        """The last lines of the job's events.jsonl (read from its end: cheap however long the log is)."""
        out = []
        for ln in _tail_lines(workdir, EVENTS_TAIL_BYTES)[-lines:]:
            if not ln.strip():
                continue
            try:
                ev = json.loads(ln)
                out.append(ev if isinstance(ev, dict) else {"event": "unparsed", "text": str(ev)})
            except ValueError:
                out.append({"event": "unparsed", "text": ln.decode(errors="replace")})
        return out


def _tail_lines(workdir: Path, max_bytes: int) -> list[bytes]:
    """The whole lines in the last `max_bytes` of workdir/events.jsonl, opened as history.open_events opens it
    (daemon/system/file_tail.py's tail_lines does the same by path, following links)."""
    fd = open_events(workdir)
    if fd is None:
        return []
    try:
        size = os.fstat(fd).st_size
        start = max(0, size - max_bytes)
        lines = os.pread(fd, size - start, start).splitlines()
    except OSError:
        return []
    finally:
        os.close(fd)
    return lines[1:] if start > 0 else lines


def energy_figures(row: dict[str, Any] | None) -> dict[str, Any]:
    """Average W, J/step and kWh of a power_jobs row (all None when nothing was measured)."""
    if not row:
        return {"avg_w": None, "j_per_step": None, "kwh": None}
    e, s, n = row["energy_j"] or 0.0, row["active_s"] or 0.0, row["steps"] or 0
    return {"avg_w": e / s if s > 0 else None, "j_per_step": e / n if n > 0 else None, "kwh": e / 3.6e6}

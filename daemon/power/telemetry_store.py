"""Power tables in the daemon's SQLite file (HOME/state.db), on their own connection.

The daemon's schema module is not touched: these tables are created here with
IF NOT EXISTS. Telemetry is written at 1 Hz, so this connection runs with
synchronous=NORMAL (WAL keeps the file consistent; a power cut may lose the
last second of samples, which is fine). Tuning profiles are worth an fsync and
are written with synchronous=FULL.

Retention: full-rate rows are kept `raw_retention_s`, then folded into one
row per GPU, job and minute (`period_s` = 60), which are kept `history_days`.
At 1 Hz that bounds the table at about 3,600 + 43,200 rows per GPU.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

from daemon.power.gpu import Sample

_SCHEMA = """
CREATE TABLE IF NOT EXISTS power_samples (
    ts REAL NOT NULL, gpu INTEGER NOT NULL, job_id TEXT, period_s REAL NOT NULL,
    power_w REAL, energy_mj REAL, energy_source TEXT, sm_mhz REAL, mem_mhz REAL, temp_c REAL,
    util_gpu REAL, util_mem REAL, limit_w REAL, throttle TEXT, simulated INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS power_samples_ts ON power_samples (ts);
CREATE INDEX IF NOT EXISTS power_samples_job ON power_samples (job_id);
CREATE TABLE IF NOT EXISTS power_jobs (
    job_id TEXT PRIMARY KEY, gpu_model TEXT, simulated INTEGER NOT NULL,
    energy_j REAL NOT NULL DEFAULT 0, active_s REAL NOT NULL DEFAULT 0, steps INTEGER NOT NULL DEFAULT 0,
    last_limit_w REAL, updated REAL
);
CREATE TABLE IF NOT EXISTS power_profiles (
    gpu_model TEXT NOT NULL, shape_key TEXT NOT NULL, created REAL NOT NULL, simulated INTEGER NOT NULL,
    default_w REAL NOT NULL, points TEXT NOT NULL,
    complete INTEGER NOT NULL DEFAULT 1,  -- 0: profiling was interrupted; the next run measures only the rest
    PRIMARY KEY (gpu_model, shape_key)
);
"""

_MINUTE = 60.0


class TelemetryStore:
    def __init__(self, db_path: Path, raw_retention_s: float = 3600, history_days: float = 30):
        self.raw_retention_s = raw_retention_s
        self.history_s = history_days * 86400
        self._lock = threading.Lock()  # the sampler thread and the supervisor thread share this connection
        self._db = sqlite3.connect(str(db_path), timeout=30, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("PRAGMA busy_timeout=30000")
        with self._lock:
            self._db.executescript(_SCHEMA)
        self._last_fold = 0.0

    # --- samples -------------------------------------------------------------------------------------------

    def add_samples(self, rows: list[Sample], jobs_by_gpu: dict[int, str] | None = None) -> None:
        jobs_by_gpu = jobs_by_gpu or {}
        vals = [
            (s.ts, s.gpu, jobs_by_gpu.get(s.gpu), 0.0, s.power_w, s.energy_mj, s.energy_source, s.sm_mhz, s.mem_mhz,
             s.temp_c, s.util_gpu, s.util_mem, s.limit_w, ",".join(s.throttle), int(s.simulated))
            for s in rows
        ]
        with self._lock:
            self._db.execute("BEGIN")  # one transaction per sampling round, not one per GPU
            try:
                self._db.executemany(f"INSERT INTO power_samples VALUES ({','.join('?' * 15)})", vals)
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def maintain(self, now: float | None = None) -> None:
        """Fold old full-rate rows into minute rows and drop history past retention (at most once a minute)."""
        now = time.time() if now is None else now
        if now - self._last_fold < _MINUTE:
            return
        self._last_fold = now
        cutoff = now - self.raw_retention_s
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                # Fold whole minutes only, so a minute is never split between a raw and a folded row.
                edge = (cutoff // _MINUTE) * _MINUTE
                self._db.execute(
                    """INSERT INTO power_samples
                       SELECT (CAST(ts / 60 AS INTEGER)) * 60.0, gpu, job_id, 60.0, AVG(power_w), MAX(energy_mj),
                              MAX(energy_source), AVG(sm_mhz), AVG(mem_mhz), MAX(temp_c), AVG(util_gpu),
                              AVG(util_mem), MIN(limit_w), GROUP_CONCAT(DISTINCT NULLIF(throttle, '')),
                              MAX(simulated)
                       FROM power_samples WHERE period_s < 60 AND ts < ?
                       GROUP BY CAST(ts / 60 AS INTEGER), gpu, job_id""",
                    (edge,),
                )
                self._db.execute("DELETE FROM power_samples WHERE period_s < 60 AND ts < ?", (edge,))
                self._db.execute("DELETE FROM power_samples WHERE ts < ?", (now - self.history_s,))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def samples(self, job_id: str | None = None, gpu: int | None = None) -> list[dict[str, Any]]:
        q, args = "SELECT * FROM power_samples WHERE 1=1", []
        if job_id is not None:
            q += " AND job_id = ?"
            args.append(job_id)
        if gpu is not None:
            q += " AND gpu = ?"
            args.append(gpu)
        with self._lock:
            cur = self._db.execute(q + " ORDER BY ts", args)
            cols = [c[0] for c in cur.description]
            return [dict(zip(cols, r, strict=True)) for r in cur.fetchall()]

    # --- per-job energy ------------------------------------------------------------------------------------

    def add_job_energy(self, job_id: str, gpu_model: str, simulated: bool, energy_j: float, seconds: float,
                       steps: int, limit_w: float | None) -> None:
        with self._lock:
            self._db.execute(
                """INSERT INTO power_jobs (job_id, gpu_model, simulated, energy_j, active_s, steps, last_limit_w, updated)
                   VALUES (?, ?, ?, ?, ?, ?, ?, ?)
                   ON CONFLICT (job_id) DO UPDATE SET energy_j = energy_j + excluded.energy_j,
                       active_s = active_s + excluded.active_s, steps = steps + excluded.steps,
                       gpu_model = excluded.gpu_model, simulated = MAX(simulated, excluded.simulated),
                       last_limit_w = excluded.last_limit_w, updated = excluded.updated""",
                (job_id, gpu_model, int(simulated), energy_j, seconds, steps, limit_w, time.time()),
            )

    def job_summary(self, job_id: str) -> dict[str, Any] | None:
        """Average W, J/step, kWh so far and steps per kWh for one job (all its attempts), or None."""
        with self._lock:
            r = self._db.execute(
                "SELECT gpu_model, simulated, energy_j, active_s, steps, last_limit_w FROM power_jobs WHERE job_id = ?",
                (job_id,),
            ).fetchone()
            n = self._db.execute("SELECT COUNT(*) FROM power_samples WHERE job_id = ?", (job_id,)).fetchone()[0]
        if r is None:
            return None
        gpu_model, simulated, energy_j, active_s, steps, limit = r
        kwh = energy_j / 3.6e6
        return {
            "job_id": job_id,
            "gpu_model": gpu_model,
            "simulated": bool(simulated),
            "avg_w": energy_j / active_s if active_s > 0 else None,
            "j_per_step": energy_j / steps if steps > 0 else None,
            "energy_j": energy_j,
            "kwh": kwh,
            "steps_per_kwh": steps / kwh if kwh > 0 else None,
            "steps": steps,
            "limit_w": limit,
            "samples": n,
        }

    # --- tuning profiles -----------------------------------------------------------------------------------

    def load_profile(self, gpu_model: str, shape_key: str) -> dict[str, Any] | None:
        with self._lock:
            r = self._db.execute(
                "SELECT default_w, points, simulated, created, complete FROM power_profiles"
                " WHERE gpu_model = ? AND shape_key = ?",
                (gpu_model, shape_key),
            ).fetchone()
        if r is None:
            return None
        return {"default_w": r[0], "points": json.loads(r[1]), "simulated": bool(r[2]), "created": r[3],
                "complete": bool(r[4])}

    def save_profile(self, gpu_model: str, shape_key: str, default_w: float, points: list[dict], simulated: bool,
                     complete: bool = True) -> None:
        with self._lock:
            self._db.execute("PRAGMA synchronous=FULL")  # a profile costs real GPU time; make it durable
            try:
                self._db.execute(
                    "INSERT OR REPLACE INTO power_profiles VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (gpu_model, shape_key, time.time(), int(simulated), default_w, json.dumps(points), int(complete)),
                )
            finally:
                self._db.execute("PRAGMA synchronous=NORMAL")

    def close(self) -> None:
        with self._lock:
            self._db.close()

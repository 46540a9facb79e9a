"""state.db's tables, and the columns added to an older state.db when it is opened."""

from __future__ import annotations

import sqlite3

SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    state TEXT NOT NULL,
    priority INTEGER NOT NULL DEFAULT 0,
    seq INTEGER NOT NULL,
    submitted_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    source TEXT,
    workdir TEXT NOT NULL,
    retries INTEGER NOT NULL DEFAULT 0,
    not_before REAL NOT NULL DEFAULT 0,
    requested TEXT,
    last_error TEXT,
    pid INTEGER,
    pid_start INTEGER,
    gpu INTEGER,
    step INTEGER NOT NULL DEFAULT 0,
    total INTEGER NOT NULL DEFAULT 0,
    loss REAL,
    s_per_step REAL,
    eta_s REAL,
    last_checkpoint TEXT,
    checkpoint_step INTEGER,
    output TEXT,
    wait_bytes INTEGER,
    val_loss REAL,
    val_step INTEGER
);
CREATE TABLE IF NOT EXISTS attempts (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id TEXT NOT NULL REFERENCES jobs(id),
    n INTEGER NOT NULL,
    started_at REAL NOT NULL,
    ended_at REAL,
    pid INTEGER,
    exit_code INTEGER,
    start_step INTEGER NOT NULL DEFAULT 0,
    end_step INTEGER,
    error TEXT
);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id TEXT,
    ts REAL NOT NULL,
    kind TEXT NOT NULL,
    data TEXT NOT NULL DEFAULT '{}'
);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
-- The job as accepted (the normalised YAML written to jobs/ID/job.yaml): what the daemon acts on, since the
-- trainer user may replace jobs/ID/job.yaml (added later: a job accepted before it has no row here).
CREATE TABLE IF NOT EXISTS accepted_jobs (job_id TEXT PRIMARY KEY REFERENCES jobs(id), text TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS jobs_by_state ON jobs(state, priority, seq);
CREATE INDEX IF NOT EXISTS attempts_by_job ON attempts(job_id, n);
-- The dashboard's events tail of one job (added later: IF NOT EXISTS builds it once on an older state.db).
CREATE INDEX IF NOT EXISTS events_by_job ON events(job_id, id);
"""

# Columns added after the first release: (name, declaration), added to an older state.db when it is opened.
ADDED_COLUMNS = (("wait_bytes", "INTEGER"),  # a job waiting for disk space: how much it needs
                 ("val_loss", "REAL"), ("val_step", "INTEGER"),  # the last validation loss (data.validation)
                 # after an out-of-memory: the floors each attempt is given (engine/memory_plan/attempt.py, JSON),
                 # and the plan the last attempt ran under, in words
                 ("memory", "TEXT"), ("memory_plan", "TEXT"))

# Progress columns a heartbeat may update without a state change.
PROGRESS_COLUMNS = {"step", "total", "loss", "s_per_step", "eta_s", "last_checkpoint", "checkpoint_step",
                    "output", "pid", "pid_start", "gpu", "last_error", "requested", "not_before", "retries",
                    "priority", "wait_bytes", "val_loss", "val_step", "memory", "memory_plan"}


def create_or_upgrade(db: sqlite3.Connection) -> None:
    """Create the tables that are missing and add the columns an older state.db lacks."""
    db.executescript(SCHEMA)
    have = {r["name"] for r in db.execute("PRAGMA table_info(jobs)")}
    for name, decl in ADDED_COLUMNS:
        if name not in have:
            db.execute(f"ALTER TABLE jobs ADD COLUMN {name} {decl}")

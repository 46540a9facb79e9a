"""The store's writes inside one transaction: a checked state move, an attempt opened or closed, an event row,
and the transaction itself (BEGIN IMMEDIATE ... COMMIT under the store's lock)."""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from typing import Any

from daemon.store import states
from daemon.store.errors import UnknownJob
from daemon.store.schema import PROGRESS_COLUMNS


def transition(db: sqlite3.Connection, job_id: str, src: str | tuple[str, ...], dst: str, reason: str,
                fields: dict[str, Any]) -> None:
    allowed_src = (src,) if isinstance(src, str) else src
    row = db.execute("SELECT state FROM jobs WHERE id=?", (job_id,)).fetchone()
    if row is None:
        raise UnknownJob(job_id)
    cur = row["state"]
    if cur not in allowed_src:
        raise states.IllegalTransition(f"job {job_id} is {cur}, not {' or '.join(allowed_src)}")
    states.check(cur, dst)
    sets, vals = ["state=?", "updated_at=?"], [dst, time.time()]
    for k, v in fields.items():
        if k not in PROGRESS_COLUMNS:
            raise ValueError(f"not a job column: {k}")
        sets.append(f"{k}=?")
        vals.append(v)
    db.execute(f"UPDATE jobs SET {', '.join(sets)} WHERE id=?", (*vals, job_id))
    add_event(db, job_id, "transition", {"from": cur, "to": dst, "reason": reason})


def start_attempt(db: sqlite3.Connection, job_id: str, start_step: int) -> int:
    n = db.execute("SELECT COALESCE(MAX(n), 0) + 1 FROM attempts WHERE job_id=?", (job_id,)).fetchone()[0]
    db.execute("INSERT INTO attempts (job_id, n, started_at, start_step) VALUES (?,?,?,?)",
               (job_id, n, time.time(), start_step))
    return n


def end_attempt(db: sqlite3.Connection, job_id: str, exit_code: int | None, end_step: int, error: str | None) -> None:
    db.execute("UPDATE attempts SET ended_at=?, exit_code=?, end_step=?, error=? WHERE job_id=? AND ended_at IS NULL",
               (time.time(), exit_code, end_step, error, job_id))


def add_event(db: sqlite3.Connection, job_id: str | None, kind: str, data: dict[str, Any]) -> None:
    db.execute("INSERT INTO events (job_id, ts, kind, data) VALUES (?,?,?,?)",
               (job_id, time.time(), kind, json.dumps(data, default=str)))


class Tx:
    """BEGIN IMMEDIATE ... COMMIT under the store's lock; ROLLBACK on any exception (a failed COMMIT included).

    A write that fails (disk full, a lock held too long) leaves no transaction open and the lock released, so
    the next write can succeed once the cause is gone.
    """

    def __init__(self, lock: threading.RLock, db: sqlite3.Connection):
        self.lock = lock
        self.db = db

    def __enter__(self) -> sqlite3.Connection:
        self.lock.acquire()
        try:
            self.db.execute("BEGIN IMMEDIATE")
        except BaseException:
            self.lock.release()
            raise
        return self.db

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None:
                try:
                    self.db.execute("COMMIT")
                    return
                except sqlite3.Error:
                    self._rollback()
                    raise
            self._rollback()
        finally:
            self.lock.release()

    def _rollback(self) -> None:
        if self.db.in_transaction:
            try:
                self.db.execute("ROLLBACK")
            except sqlite3.Error:
                pass  # SQLite rolled it back itself

"""The one persisted state: SQLite in HOME/state.db (WAL, synchronous=FULL).

Tables: jobs (one row per job, its state and latest progress), attempts (one
row per trainer start: start, end, exit code, steps done, error) and events
(what happened to a job, in order). The daemon is the only writer; the
socket threads and the supervisor share one connection behind a lock.
"""

from __future__ import annotations

import json
import secrets
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from daemon.store import sql, states
from daemon.store.errors import AmbiguousJob, StoreUnusable, UnknownJob
from daemon.store.schema import PROGRESS_COLUMNS, create_or_upgrade
from daemon.store.unusable import unusable_reason


class Store:
    def __init__(self, path: Path, timeout_s: float = 30.0):
        """Open (or create) the database; StoreUnusable if it is corrupt or stays locked for `timeout_s`."""
        self.path = Path(path)
        self._lock = threading.RLock()
        self.db = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None, timeout=timeout_s)
        try:
            self.db.row_factory = sqlite3.Row
            self.db.execute("PRAGMA journal_mode=WAL")
            # FULL: a committed transition survives a power cut, not only a process crash.
            self.db.execute("PRAGMA synchronous=FULL")
            self.db.execute("PRAGMA foreign_keys=ON")
            create_or_upgrade(self.db)
            # Take the write lock once: a file another process keeps locked is found now, not at the first job.
            self.db.execute("BEGIN IMMEDIATE")
            self.db.execute("COMMIT")
        except sqlite3.DatabaseError as e:
            self.db.close()
            why = unusable_reason(self.path, e)
            if why is None:
                raise
            raise StoreUnusable(why) from None

    def close(self) -> None:
        with self._lock:
            self.db.close()

    # ------------------------------------------------------------ helpers
    def _tx(self):
        return sql.Tx(self._lock, self.db)

    def new_id(self, name: str) -> str:
        """NAME-xxxx: readable, unique among all jobs ever accepted here."""
        with self._lock:
            while True:
                jid = f"{name}-{secrets.token_hex(2)}"
                if self.db.execute("SELECT 1 FROM jobs WHERE id=?", (jid,)).fetchone() is None:
                    return jid

    # ------------------------------------------------------------ jobs
    def add_job(self, job_id: str, name: str, workdir: Path, priority: int, total: int, source: str | None,
                text: str | None = None, state: str = states.QUEUED) -> None:
        """A new job (queued, or fetching from a mirror); `text`: the job as accepted (normalised YAML), kept for
        accepted_text()."""
        now = time.time()
        with self._tx() as db:
            seq = db.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM jobs").fetchone()[0]
            db.execute(
                "INSERT INTO jobs (id, name, state, priority, seq, submitted_at, updated_at, source, workdir, total)"
                " VALUES (?,?,?,?,?,?,?,?,?,?)",
                (job_id, name, state, priority, seq, now, now, source, str(workdir), total),
            )
            if text is not None:
                db.execute("INSERT INTO accepted_jobs (job_id, text) VALUES (?,?)", (job_id, text))
            sql.add_event(db, job_id, "accepted", {"source": source})

    def accepted_text(self, job_id: str) -> str | None:
        """The job as the daemon accepted it (None: accepted by a lorad that did not keep it here)."""
        with self._lock:
            row = self.db.execute("SELECT text FROM accepted_jobs WHERE job_id=?", (job_id,)).fetchone()
        return None if row is None else row["text"]

    def get(self, job_id: str) -> dict[str, Any]:
        with self._lock:
            row = self.db.execute("SELECT * FROM jobs WHERE id=?", (job_id,)).fetchone()
        if row is None:
            raise UnknownJob(job_id)
        return dict(row)

    def find(self, ref: str) -> dict[str, Any]:
        """A job by its id; else by name; else by id prefix. Never a guess between jobs.

        A name shared by several jobs means the one of them that is not finished, if exactly one is;
        otherwise (and for a prefix of several ids) AmbiguousJob lists them, newest first.
        """
        with self._lock:
            row = self.db.execute("SELECT * FROM jobs WHERE id=?", (ref,)).fetchone()
            if row is not None:
                return dict(row)
            rows = [dict(r) for r in self.db.execute("SELECT * FROM jobs WHERE name=? ORDER BY seq DESC", (ref,))]
            if len(rows) > 1:
                unfinished = [r for r in rows if r["state"] not in states.FINAL]
                if len(unfinished) == 1:
                    return unfinished[0]
                raise AmbiguousJob(ref, rows)
            if not rows:
                rows = [dict(r) for r in self.db.execute(
                    "SELECT * FROM jobs WHERE id LIKE ? ESCAPE '\\' ORDER BY seq DESC",
                    (ref.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%",))]
                if len(rows) > 1:
                    raise AmbiguousJob(ref, rows)
        if not rows:
            raise UnknownJob(ref)
        return rows[0]

    def unfinished_named(self, name: str) -> list[dict[str, Any]]:
        """The jobs of this name that are not finished, newest first."""
        q = ",".join("?" * len(states.FINAL))
        with self._lock:
            rows = self.db.execute(f"SELECT * FROM jobs WHERE name=? AND state NOT IN ({q}) ORDER BY seq DESC",
                                   (name, *sorted(states.FINAL))).fetchall()
        return [dict(r) for r in rows]

    def jobs(self, job_states: tuple[str, ...] | None = None) -> list[dict[str, Any]]:
        with self._lock:
            if job_states:
                q = ",".join("?" * len(job_states))
                rows = self.db.execute(f"SELECT * FROM jobs WHERE state IN ({q}) ORDER BY seq", job_states).fetchall()
            else:
                rows = self.db.execute("SELECT * FROM jobs ORDER BY seq").fetchall()
        return [dict(r) for r in rows]

    def next_queued(self, now: float, longest_wait: float | None = None) -> dict[str, Any] | None:
        """First in line: highest priority, then earliest arrival, whose backoff has passed.

        A backoff is a wall-clock time (it outlives the daemon and a reboot), so a clock set back while a job waits
        would hold it for as long as the jump (an NTP step of a day: a day). A backoff that ends more than
        `longest_wait` (the longest the daemon ever waits) from now began before such a jump: it has passed."""
        late = "" if longest_wait is None else " OR not_before>?"
        args = (states.QUEUED, now) if longest_wait is None else (states.QUEUED, now, now + longest_wait)
        with self._lock:
            row = self.db.execute(
                f"SELECT * FROM jobs WHERE state=? AND (not_before<=?{late}) ORDER BY priority DESC, seq ASC LIMIT 1",
                args,
            ).fetchone()
        return dict(row) if row else None

    def transition(self, job_id: str, src: str | tuple[str, ...], dst: str, reason: str = "", **fields: Any) -> None:
        """Move a job from `src` (or one of several) to `dst`, checked against the table, in one transaction."""
        with self._tx() as db:
            sql.transition(db, job_id, src, dst, reason, fields)

    def begin_attempt(self, job_id: str, start_step: int, **fields: Any) -> int:
        """QUEUED → RUNNING and a new attempt row, in one transaction (both or neither). The attempt's number."""
        with self._tx() as db:
            # A new attempt starts with no stop asked of it: a request is only ever made of a running attempt.
            sql.transition(db, job_id, states.QUEUED, states.RUNNING, "trainer starting", {"requested": None, **fields})
            return sql.start_attempt(db, job_id, start_step)

    def end_run(self, job_id: str, exit_code: int | None, end_step: int, error: str | None,
                plan: Callable[[dict[str, Any]], tuple[list[tuple[str, str, dict[str, Any]]], Any]]) -> Any:
        """Close the open attempt and move a running job on, in one transaction; returns plan's result.

        plan(the job's row as it is now, inside the transaction, with `previous_errors`: the errors of its last
        two closed attempts, newest first) → (moves, result), moves being
        [(dst, reason, fields), ...] walked from RUNNING (e.g. interrupted, then queued). Nothing another
        thread writes (a cancel, say) can land between reading the row and the last move.
        """
        with self._tx() as db:
            row = db.execute("SELECT * FROM jobs WHERE id=?", (job_id,)).fetchone()
            if row is None:
                raise UnknownJob(job_id)
            job = dict(row)
            job["previous_errors"] = [r["error"] for r in db.execute(
                "SELECT error FROM attempts WHERE job_id=? AND ended_at IS NOT NULL ORDER BY n DESC LIMIT 2",
                (job_id,))]
            moves, result = plan(job)
            sql.end_attempt(db, job_id, exit_code, end_step, error)
            src = states.RUNNING
            for dst, reason, fields in moves:
                sql.transition(db, job_id, src, dst, reason, fields)
                src = dst
            return result

    def request(self, job_id: str, what: str, seen_state: str) -> bool:
        """Record a pause or cancel for the trainer, only if the job is still in the state the asker saw.

        One conditional UPDATE: a trainer that exited between the asker's read and this write (the job queued
        again, or finished) leaves the row as it is, and the caller refuses (False) instead of leaving a flag
        that would stop the next attempt at once or stay on a finished job.
        """
        with self._tx() as db:
            n = db.execute("UPDATE jobs SET requested=?, updated_at=? WHERE id=? AND state=?",
                           (what, time.time(), job_id, seen_state)).rowcount
            if n:
                sql.add_event(db, job_id, "requested", {"what": what, "state": seen_state})
            return n == 1

    def update(self, job_id: str, **fields: Any) -> None:
        """Progress and bookkeeping columns; never the state (that is transition()'s job)."""
        if not fields:
            return
        for k in fields:
            if k not in PROGRESS_COLUMNS:
                raise ValueError(f"not a job column: {k}")
        with self._tx() as db:
            db.execute(
                f"UPDATE jobs SET {', '.join(f'{k}=?' for k in fields)}, updated_at=? WHERE id=?",
                (*fields.values(), time.time(), job_id),
            )

    # ------------------------------------------------------------ attempts
    def record_trainer(self, job_id: str, n: int, pid: int, pid_start: int | None) -> None:
        """The trainer's pid (and start time) on the job and on its attempt, in one transaction."""
        with self._tx() as db:
            db.execute("UPDATE jobs SET pid=?, pid_start=?, updated_at=? WHERE id=?",
                       (pid, pid_start, time.time(), job_id))
            db.execute("UPDATE attempts SET pid=? WHERE job_id=? AND n=?", (pid, job_id, n))

    def attempt_training(self, job_id: str, n: int, start_step: int) -> None:
        """Attempt n trains: its start step is where the trainer really resumed (its checkpoint, not the step the
        store last heard), and the job's note of an earlier attempt's end (a crash, a cut-off) is stale now."""
        with self._tx() as db:
            db.execute("UPDATE attempts SET start_step=? WHERE job_id=? AND n=?", (start_step, job_id, n))
            db.execute("UPDATE jobs SET last_error=NULL, updated_at=? WHERE id=? AND state=?",
                       (time.time(), job_id, states.RUNNING))

    def attempts(self, job_id: str) -> list[dict[str, Any]]:
        with self._lock:
            rows = self.db.execute("SELECT * FROM attempts WHERE job_id=? ORDER BY n", (job_id,)).fetchall()
        return [dict(r) for r in rows]

    # ------------------------------------------------------------ events and meta
    def event(self, job_id: str | None, kind: str, **data: Any) -> None:
        with self._tx() as db:
            sql.add_event(db, job_id, kind, data)

    def prune_jobless_events(self, before: float, keep: int) -> int:
        """Events of no job (rejections) older than `before` (time.time()) and all but the newest `keep`: pruned
        as rejected/ is (daemon/intake/prune.py), so a flood of bad job files cannot grow state.db for ever."""
        with self._tx() as db:
            return db.execute("DELETE FROM events WHERE job_id IS NULL AND (ts < ? OR id NOT IN "
                              "(SELECT id FROM events WHERE job_id IS NULL ORDER BY id DESC LIMIT ?))",
                              (before, keep)).rowcount

    def prune_finished_events(self, before: float, keep: int, batch: int = 5000) -> int:
        """The events of finished jobs (succeeded, failed, cancelled) that ended before `before` (time.time()), and
        of all but the newest `keep` finished jobs, at most `batch` rows a call (a backlog goes over several
        calls, never one long write under the store's lock). A job that is not finished keeps every event (its
        `lorad status`), and every job keeps its `imported` event (status's "imported from", one row a job)."""
        final = sorted(states.FINAL)
        q = ",".join("?" * len(final))
        with self._tx() as db:
            return db.execute(
                f"DELETE FROM events WHERE id IN (SELECT e.id FROM events e JOIN jobs j ON j.id = e.job_id "
                f"WHERE j.state IN ({q}) AND e.kind != 'imported' AND (j.updated_at < ? OR j.id NOT IN "
                f"(SELECT id FROM jobs WHERE state IN ({q}) ORDER BY updated_at DESC LIMIT ?)) LIMIT ?)",
                (*final, before, *final, keep, batch)).rowcount

    def events(self, job_id: str, limit: int = 100) -> list[dict[str, Any]]:
        with self._lock:
            rows = self.db.execute("SELECT * FROM events WHERE job_id=? ORDER BY id DESC LIMIT ?",
                                   (job_id, limit)).fetchall()
        return [dict(r, data=json.loads(r["data"])) for r in reversed(rows)]

    def first_event(self, job_id: str, kind: str) -> dict[str, Any] | None:
        """The job's first event of this kind (e.g. imported), its data decoded; None when it has none."""
        with self._lock:
            row = self.db.execute("SELECT * FROM events WHERE job_id=? AND kind=? ORDER BY id LIMIT 1",
                                  (job_id, kind)).fetchone()
        return dict(row, data=json.loads(row["data"])) if row else None

    def get_meta(self, key: str, default: str | None = None) -> str | None:
        with self._lock:
            row = self.db.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return row["value"] if row else default

    def set_meta(self, key: str, value: str) -> None:
        with self._tx() as db:
            db.execute("INSERT INTO meta (key, value) VALUES (?,?) ON CONFLICT(key) DO UPDATE SET value=excluded.value",
                       (key, value))

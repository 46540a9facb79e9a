"""A job's checks run off the thread that asked, each in a worker thread with a deadline.

Validating a job reads the files it names (engine/config/paths.py), and any socket-group member names them:
a FIFO, a file on a hung mount, a folder of a million entries. The engine's reads are bounded
(engine/config/bounded.py: regular files only, byte caps, a time budget checked between steps); what no
Python code can bound, a syscall that blocks, is bounded here: the check runs in its own daemon thread and is
given up at its deadline (JobInvalid naming the key and path it was at), the thread left to finish or hang
alone.

Two ways to ask:
- `run(fn)` waits for the verdict, at most the deadline (a socket connection's thread: `lorad submit`, the
  dashboard's form);
- `verdict(key, fn, wait)` starts the check once per key and waits at most `wait` seconds: PENDING while it
  runs, so the service loop (and start-up recovery) never waits on one file; it asks again on later ticks.

The loop runs at most MAX_RUNNING checks at once (a flood of slow ones waits its turn, PENDING), and at most
MAX_HUNG checks that outlived their deadline may still be running: past that, no new check starts (PENDING, or
JobInvalid for `run`) until one ends, so a flood of jobs on a hung mount costs threads, bounded.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from engine.config import bounded
from engine.errors import JobInvalid

PENDING = object()  # verdict(): the check is still running (or waits for a thread)
GRACE_S = 0.5  # past the budget's deadline, for a check that ends by itself (CheckTimedOut names the path best)
MAX_HUNG = 16
MAX_RUNNING = 4  # checks the loop has running at once (verdict); a flood of slow ones waits its turn in incoming/


class _Check:
    def __init__(self, fn: Callable[[], Any], seconds: float):
        self.fn = fn
        self.seconds = seconds
        self.budget: bounded.Budget | None = None
        self.done = threading.Event()
        self.started = time.monotonic()
        self.result: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        with bounded.budget(self.seconds) as b:
            self.budget = b
            try:
                self.result = self.fn()
            except BaseException as e:  # noqa: BLE001 — handed to whoever asks for the verdict
                self.error = e
            finally:
                self.done.set()

    def overdue(self) -> bool:
        return time.monotonic() >= self.started + self.seconds + GRACE_S

    def outcome(self) -> Any:
        if self.done.is_set():
            if self.error is not None:
                raise self.error
            return self.result
        where = self.budget.spent_message() if self.budget is not None else "checking took too long"
        raise bounded.CheckTimedOut(where)


class Checks:
    def __init__(self, seconds: float, log=None):
        self.seconds = seconds
        self.log = log
        self._lock = threading.Lock()
        self._running: dict[str, _Check] = {}
        self._hung: list[_Check] = []  # given up, still running

    def _start(self, fn: Callable[[], Any], most_running: int | None = None) -> _Check | None:
        with self._lock:
            self._hung = [c for c in self._hung if not c.done.is_set()]
            if len(self._hung) >= MAX_HUNG:
                return None
        if most_running is not None and sum(not c.done.is_set() for c in self._running.values()) >= most_running:
            return None
        c = _Check(fn, self.seconds)
        threading.Thread(target=c.run, name="job-check", daemon=True).start()
        return c

    def _give_up(self, c: _Check) -> None:
        with self._lock:
            self._hung.append(c)
        if self.log is not None:
            self.log.warning("job_check_abandoned", where=c.budget.where if c.budget else None,
                             seconds=self.seconds, still_running=len(self._hung))

    def run(self, fn: Callable[[], Any]) -> Any:
        """fn's result (or its exception), waiting at most the deadline; CheckTimedOut naming the path after."""
        c = self._start(fn)
        if c is None:
            raise JobInvalid(f"{MAX_HUNG} earlier job checks are still hung on their files; try again later")
        if not c.done.wait(self.seconds + GRACE_S):
            self._give_up(c)
        return c.outcome()

    def verdict(self, key: str, fn: Callable[[], Any], wait: float | None) -> Any:
        """fn's result for `key` (its exception raised), or PENDING while it runs; fn is called once per key,
        until a verdict is returned. wait: how long to wait now (None: until the deadline)."""
        c = self._running.get(key)
        if c is None:
            c = self._start(fn, MAX_RUNNING)
            if c is None:
                return PENDING  # too many running or hung: started on a later call
            self._running[key] = c
        left = c.started + self.seconds + GRACE_S - time.monotonic()
        c.done.wait(max(0.0, left if wait is None else min(wait, left)))
        if not c.done.is_set() and not c.overdue():
            return PENDING
        del self._running[key]
        if not c.done.is_set():
            self._give_up(c)
        return c.outcome()

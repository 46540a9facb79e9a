"""The heartbeat queue between the trainers' stdout readers and the loop: bounded, whatever a trainer prints.

A reader thread puts (job id, attempt, event) for every checked line; the loop drains it each tick. A trainer that
prints faster than the loop drains (a stalled store, a flood of events) must not grow the daemon's memory, and its
reader must not block (that would block the trainer on its stdout pipe). So the queue holds at most `limit` items:
when full, the oldest step event goes first (a later step of the same attempt carries the progress it had: merged,
not lost), and only when there is none, the oldest item. What was dropped is counted; the loop logs it once.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

LIMIT = 4096  # items; a tick drains them all, and a step event is a few hundred bytes


def _is_step(item: tuple[str, int, Any]) -> bool:
    ev = item[2]
    return isinstance(ev, dict) and ev.get("event") == "step"


class BeatQueue:
    """put() from reader threads, pop() from the loop. `merged` counts step events dropped for a later one,
    `dropped` other events dropped because the queue was full of them."""

    def __init__(self, limit: int = LIMIT):
        self.limit = limit
        self._items: deque[tuple[str, int, Any]] = deque()
        self._lock = threading.Lock()
        self.merged = 0
        self.dropped = 0

    def put(self, item: tuple[str, int, Any]) -> None:
        with self._lock:
            if len(self._items) >= self.limit:
                self._make_room()
            self._items.append(item)

    def _make_room(self) -> None:
        for i, old in enumerate(self._items):
            if _is_step(old):
                del self._items[i]
                self.merged += 1
                return
        self._items.popleft()
        self.dropped += 1

    def pop(self) -> tuple[str, int, Any] | None:
        """The oldest item, or None when empty (one at a time: a beat the loop fails on leaves the rest queued)."""
        with self._lock:
            return self._items.popleft() if self._items else None

    def __len__(self) -> int:
        return len(self._items)

"""Test doubles shared by the tests: a recording event log and a clock the test moves by hand."""

from __future__ import annotations


class RecLog:
    """Records `log.<level>(event, **fields)` calls so a test can ask what was said."""

    def __init__(self):
        self.events: list[tuple[str, str, dict]] = []

    def __getattr__(self, level):
        return lambda event, **kw: self.events.append((level, event, kw))

    def named(self, event):
        return [kw for _, e, kw in self.events if e == event]


class Clock:
    """A time source (`clock()` → seconds) that only moves when the test sets `t`."""

    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t

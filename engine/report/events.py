"""Structured job events: JSON lines to jobs/ID/events.jsonl and (for the supervisor) to stdout.

Every line is one structlog event with a timestamp, a level and an `event`
name. The supervisor treats every line as a heartbeat (and `phase` lines as the
phase that sets its hang limit); long phases send `heartbeat` lines so that they
are not taken for a hang. The schema is documented in docs/service-and-cli.md ("Events and logs").
"""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path
from typing import IO, Any

import structlog


class _Sinks:
    """A structlog logger that writes each rendered line to several files."""

    def __init__(self, files: list[IO[str]]):
        self.files = files
        self.lock = threading.Lock()

    def msg(self, line: str) -> None:
        with self.lock:
            for f in self.files:
                try:
                    f.write(line + "\n")
                    f.flush()
                except (OSError, ValueError):
                    # A full disk or a closed pipe must not kill training; the checkpoint path reports disk errors.
                    pass

    info = warning = error = debug = critical = msg


class EventLog:
    def __init__(self, path: Path | None, to_stdout: bool, **bound: Any):
        self._file = open(path, "a", encoding="utf-8") if path is not None else None
        if self._file is not None and _ends_mid_line(path):
            self._file.write("\n")  # a line torn by a kill or power cut must not swallow this run's first event
        files: list[IO[str]] = [f for f in (self._file, sys.stdout if to_stdout else None) if f is not None]
        self._log = structlog.wrap_logger(
            _Sinks(files),
            processors=[
                structlog.processors.add_log_level,
                structlog.processors.TimeStamper(fmt="iso", utc=True, key="ts"),
                structlog.processors.JSONRenderer(sort_keys=False),
            ],
        ).bind(**bound)
        self.listeners: list = []
        self.step = 0  # the newest step any event of this run named (resumed, step, checkpoint): where an error is

    def info(self, event: str, **kw: Any) -> None:
        self._emit("info", event, kw)

    def warning(self, event: str, **kw: Any) -> None:
        self._emit("warning", event, kw)

    def error(self, event: str, **kw: Any) -> None:
        self._emit("error", event, kw)

    def _emit(self, level: str, event: str, kw: dict[str, Any]) -> None:
        for key in ("step", "from_step"):
            if isinstance(kw.get(key), int) and not isinstance(kw[key], bool):
                self.step = max(self.step, kw[key])
        getattr(self._log, level)(event, **kw)
        for fn in self.listeners:
            fn(level, event, kw)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _ends_mid_line(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            if f.tell() == 0:
                return False
            f.seek(-1, 2)
            return f.read(1) != b"\n"
    except OSError:
        return False


def read_events(workdir: Path, offset: int = 0) -> list[dict[str, Any]]:
    """The job's events so far (those written after `offset` bytes), skipping a line torn by a kill mid-write.

    For readers of a live or killed job; `offset` (the file's size at some moment) gives one run's events.
    """
    path = Path(workdir) / "events.jsonl"
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return []
    return [ev for ev in decode_lines(data) if isinstance(ev, dict)]


def decode_lines(data: bytes) -> list[Any]:
    """The JSON values of these whole lines, skipping a torn one (a kill mid-write, after which the engine starts a
    new line). One decode of the lines joined as an array is about twice as fast as one per line (20,000 step
    lines: the dashboard's job page); a chunk with a torn line goes the slow way, which skips just that line."""
    lines = [line for line in data.split(b"\n") if line.strip()]
    if not lines:
        return []
    try:
        return json.loads(b"[" + b",".join(lines) + b"]")
    except ValueError:
        pass
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out

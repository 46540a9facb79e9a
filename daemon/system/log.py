"""The daemon's structured log: structlog JSON lines to stdout (journald under systemd), and per-job lines
appended to jobs/ID/events.jsonl next to the trainer's own events (same schema: event, level, ts, job). The trainer
user may replace events.jsonl: it is appended to by descriptor, never through a symlink (daemon/system/safe_files.py)."""

from __future__ import annotations

import json
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import structlog

from daemon.system.safe_files import append

EVENTS_MODE = 0o640  # what the trainer's umask (0027) gives the events it writes: the group reads, never writes


def setup(stream=None) -> Any:
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True, key="ts"),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(sort_keys=False),
        ],
        logger_factory=structlog.PrintLoggerFactory(stream or sys.stdout),
        cache_logger_on_first_use=False,
    )
    return structlog.get_logger("lorad").bind(source="daemon")


def job_event(workdir: Path, job_id: str, event: str, level: str = "info", **kw: Any) -> None:
    """Append one daemon-side line (accepted, attempt_started, retry_scheduled, ...) to the job's events.jsonl."""
    line = {"job": job_id, **kw, "event": event, "level": level, "source": "daemon",
            "ts": datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")}
    try:
        append(Path(workdir) / "events.jsonl", (json.dumps(line, default=str) + "\n").encode(), EVENTS_MODE)
    except OSError:
        pass  # a full disk, or not a regular file of its own (a planted symlink): the daemon log and the DB have it

"""The daemon's structured log: structlog JSON lines to stdout (journald under systemd), and per-job lines
appended to jobs/ID/events.jsonl next to the trainer's own events (same schema: event, level, ts, job)."""

from __future__ import annotations

import json
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import structlog


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
        with open(Path(workdir) / "events.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps(line, default=str) + "\n")
    except OSError:
        pass  # the job's directory is on a full disk: the daemon log and the DB still have it

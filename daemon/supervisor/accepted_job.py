"""The job the daemon acts on: the one it accepted, as state.db keeps it, never jobs/ID/job.yaml read again.

jobs/ID/ is handed to the trainer user, who may replace job.yaml with anything (another job, a FIFO that would
block the service loop in open, a symlink). What the daemon decides from a job (its GPUs, its power section,
whether it spans machines, its power profile) comes from the normalised YAML that intake validated and stored
with the job row (Store.accepted_text). The trainer reads job.yaml itself, and enforces the daemon's policy on it.

A job accepted by a lorad that did not keep it in state.db has only its job.yaml: that is read by descriptor
(daemon/system/safe_files.py: no symlink, no FIFO, size-capped), and an unreadable one reads as {} (defaults;
the trainer reports the file itself, exit 65).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from daemon.store.db import Store
from daemon.system.safe_files import read_bytes
from engine.config.reading import MAX_JOB_FILE_BYTES, YamlProblem, read_yaml

MAX_ALIASES = 100  # a job.yaml the trainer user wrote: no YAML bombs either


def accepted_doc(store: Store, job: dict[str, Any]) -> dict[str, Any]:
    """The accepted job of a store row, as a mapping ({} when there is none to read)."""
    text = store.accepted_text(job["id"])
    if text is None:
        try:
            data = read_bytes(Path(job["workdir"]) / "job.yaml", MAX_JOB_FILE_BYTES)
            if len(data) > MAX_JOB_FILE_BYTES:
                return {}
            text = data.decode("utf-8")
        except (OSError, UnicodeDecodeError):
            return {}
    try:
        doc = read_yaml(text, MAX_ALIASES)
    except YamlProblem:
        return {}
    return doc if isinstance(doc, dict) else {}

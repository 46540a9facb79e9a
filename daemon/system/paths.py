"""Where lorad keeps its state: the home directory and its fixed layout (see DESIGN.md)."""

from __future__ import annotations

import os
from pathlib import Path

SYSTEM_HOME = Path("/var/lib/lorad")
JOB_DIR_MODE = 0o750  # jobs/ and jobs/ID/: explicit, whatever the daemon's umask
JOB_FILE_MODE = 0o644  # job.yaml, submitted.yaml: the trainer (another user under root) reads them


def default_home() -> Path:
    """$LORAD_HOME, else the systemd StateDirectory when run as a service, else ~/.local/share/lorad."""
    if os.environ.get("LORAD_HOME"):
        return Path(os.environ["LORAD_HOME"])
    if os.environ.get("STATE_DIRECTORY"):
        return Path(os.environ["STATE_DIRECTORY"].split(":")[0])
    if os.environ.get("INVOCATION_ID") and os.geteuid() == 0:
        return SYSTEM_HOME
    return Path.home() / ".local" / "share" / "lorad"


def job_dir(home: Path, job_id: str) -> Path:
    return Path(home) / "jobs" / job_id

"""Where what a home's jobs share lives: the content-keyed cache (engine/storage/cache.py) of HOME/jobs/ID is HOME/cache.

Importable without torch: the daemon hands the shared cache directory to the trainer user with the job's own
(daemon/system/trainer_user.py).
"""

from __future__ import annotations

from pathlib import Path


def cache_dir(workdir: Path) -> Path:
    """HOME/cache for a job directory HOME/jobs/ID (shared by the home's jobs), else WORKDIR/cache."""
    workdir = Path(workdir).resolve()
    return workdir.parent.parent / "cache" if workdir.parent.name == "jobs" else workdir / "cache"

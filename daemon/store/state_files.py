"""state.db's mode: written by the daemon alone, whatever umask the daemon runs under.

The unit's UMask=0007 made state.db (and SQLite's -wal and -shm beside it) group-writable, so a member of
the socket group could rewrite a job's row. The file is created (or set) 0640 before SQLite opens it, and
SQLite gives the -wal and -shm files it creates the database file's own mode.
"""

from __future__ import annotations

import os
from pathlib import Path

STATE_DB_MODE = 0o640
SIDE_FILES = ("-wal", "-shm", "-journal")


def protect_state_db(db_path: Path) -> None:
    fd = os.open(db_path, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, STATE_DB_MODE)
    try:
        os.fchmod(fd, STATE_DB_MODE)
    finally:
        os.close(fd)
    for suffix in SIDE_FILES:
        try:
            os.chmod(f"{db_path}{suffix}", STATE_DB_MODE)
        except FileNotFoundError:
            pass

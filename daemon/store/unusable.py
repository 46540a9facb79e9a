"""Why state.db cannot be used (corrupt, or locked by another process, and by whom): one line for the operator."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path


def unusable_reason(path: Path, e: BaseException) -> str | None:
    """One line for an SQLite error that a restart cannot cure (a corrupt or locked file); None for any other."""
    code = getattr(e, "sqlite_errorcode", None)
    if not isinstance(e, sqlite3.DatabaseError) or code is None:
        return None
    primary = code & 0xFF  # extended codes (SQLITE_BUSY_RECOVERY, ...) carry the primary code in the low byte
    if primary in (sqlite3.SQLITE_NOTADB, sqlite3.SQLITE_CORRUPT):
        return (f"{path} is not a lorad database (corrupt?): move it aside to start fresh "
                f"— job directories under jobs/ are not touched")
    if primary in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED):
        pids = holders(path)
        who = f"pid {', '.join(map(str, pids))}" if pids else "pid unknown"
        return f"{path} is locked by another process ({who}): stop it, then start lorad again"
    return None


def holders(path: Path) -> list[int]:
    """Other processes (that we may look at) with the database, its WAL or its shared memory file open."""
    names = {str(Path(path).resolve()) + suffix for suffix in ("", "-wal", "-shm", "-journal")}
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        try:
            fds = os.listdir(f"/proc/{d}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{d}/fd/{fd}") in names:
                    out.append(int(d))
                    break
            except OSError:
                continue
    return sorted(out)

"""rejected/: a job file that failed validation, beside NAME.error.txt saying why, never deleted by intake
(daemon/intake/prune.py keeps the newest). The reason is stored capped; `lorad status` lists the recent ones,
read back from these files (durable, so they survive a restart)."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

REJECTED_HEADER = "lorad rejected "
REJECTED_FILE_MODE = 0o640  # rejected/NAME.error.txt: the socket group reads why
ERROR_SUFFIX = ".error.txt"
MAX_REASON_CHARS = 4096  # a rejection's reason as stored (rejected/*.error.txt, state.db, the log line)


def capped(reason: str, most: int = MAX_REASON_CHARS) -> str:
    """A reason cut to `most` characters, saying how much was cut (validators cut what they echo already)."""
    return reason if len(reason) <= most else f"{reason[:most]}… ({len(reason) - most} more characters)"


def recent_rejections(rejected: Path, now: float, within_s: float, most: int) -> tuple[list[dict[str, Any]], int]:
    """The newest `most` rejections of the last `within_s` seconds, newest first, and how many there were in all.

    Read back from rejected/NAME.error.txt (durable, so they survive a restart; deleting a file forgets it):
    {"file": NAME, "at": when (the error file's mtime), "reason": its reason on one line, "error_file": path}.
    Only regular files that start the way _reject writes them count; nothing is followed through a symlink.
    """
    found = []
    try:
        entries = list(os.scandir(rejected))
    except OSError:
        return [], 0
    for e in entries:
        if not e.name.endswith(ERROR_SUFFIX):
            continue
        try:
            st = e.stat(follow_symlinks=False)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode) and now - st.st_mtime <= within_s:
            found.append((st.st_mtime, e))
    found.sort(key=lambda t: (t[0], t[1].name), reverse=True)
    out = []
    for mtime, e in found:
        if len(out) == most:
            break
        reason = _rejection_reason(Path(e.path))
        if reason is not None:
            out.append({"file": e.name[: -len(ERROR_SUFFIX)], "at": mtime, "reason": reason, "error_file": e.path})
    return out, len(found)


def _rejection_reason(path: Path) -> str | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        text = os.read(fd, 8192).decode("utf-8", errors="replace")
    except OSError:
        return None
    finally:
        os.close(fd)
    header, _, body = text.partition("\n")
    if not (header.startswith(REJECTED_HEADER) and header.endswith(":")):
        return None  # not one of ours (a rejected file that happens to be called *.error.txt)
    shown = header[len(REJECTED_HEADER):-1]
    reason = " ".join(body.split())
    return reason.removeprefix(f"{shown}: ") or "(no reason recorded)"

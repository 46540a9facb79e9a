"""The whole lines at the end of a file that only grows (a trainer's events.jsonl or stderr log), read from its
end: the cost does not grow with the file. The file is in jobs/ID/, which the trainer user may change: it is
opened by descriptor, never through a symlink and never blocking (daemon/system/safe_files.py)."""

from __future__ import annotations

import os
from pathlib import Path

from daemon.system.safe_files import open_file


def tail_lines(path: Path, max_bytes: int) -> list[bytes] | None:
    """The lines in the last `max_bytes` of the file, without the first one when the read began inside it
    (that line is cut). None when the file cannot be read, or is not a regular file of its own."""
    try:
        fd = open_file(path)
        try:
            size = os.fstat(fd).st_size
            start = max(0, size - max_bytes)
            lines = os.pread(fd, size - start, start).splitlines()
        finally:
            os.close(fd)
    except OSError:
        return None
    return lines[1:] if start > 0 else lines

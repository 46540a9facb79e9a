"""The whole lines at the end of a file that only grows (a trainer's events.jsonl or stderr log), read from its
end: the cost does not grow with the file."""

from __future__ import annotations

import os
from pathlib import Path


def tail_lines(path: Path, max_bytes: int) -> list[bytes] | None:
    """The lines in the last `max_bytes` of the file, without the first one when the read began inside it
    (that line is cut). None when the file cannot be read."""
    try:
        with open(path, "rb") as f:
            start = max(0, f.seek(0, os.SEEK_END) - max_bytes)
            f.seek(start)
            lines = f.read().splitlines()
    except OSError:
        return None
    return lines[1:] if start > 0 else lines

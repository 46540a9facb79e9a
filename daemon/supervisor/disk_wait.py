"""A job whose trainer found the disk full (exit 74) waits for free space instead of spending its retries.

How much it waits for: the size of its newest committed checkpoint (the next save needs as much), or
NO_CHECKPOINT_NEED_BYTES when it has none yet. The supervisor polls the free space of the job directory's
filesystem (shutil.disk_usage) every DISK_POLL_S and requeues the job once that much is free.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from daemon.supervisor.disk_progress import committed_checkpoints

DISK_POLL_S = 5.0
NO_CHECKPOINT_NEED_BYTES = 1 << 30


def bytes_needed(workdir: Path) -> int:
    newest = committed_checkpoints(workdir)
    return newest[0].bytes if newest else NO_CHECKPOINT_NEED_BYTES


def free_bytes(path: Path) -> int:
    return shutil.disk_usage(path).free


def waiting_note(need: int | None) -> str:
    """`disk full, 2.4 GB needed`: what `lorad status` says of a waiting job."""
    return f"disk full, {(need or NO_CHECKPOINT_NEED_BYTES) / 1e9:.1f} GB needed"

"""Taking a job's trainer.lock before its trainer starts, and what to do when someone else holds it.

jobs/ID/trainer.lock allows one trainer per job, whoever started it (the daemon, or `lorad run` in the
foreground; daemon/system/lock.py). When the daemon finds it held, the job never gets a second trainer: it waits a
little while the next job in line may take the device, and the holder, if it is a trainer of this home (an
earlier daemon's orphan that outlived start-up recovery), is asked once to checkpoint and stop. Anything
else holding it (`lorad run`, say) is waited for, and said once.
"""

from __future__ import annotations

import fcntl
import os
import signal
import time
from pathlib import Path

from daemon.store.db import Store
from daemon.system import proc
from daemon.system.lock import LOCK_MODE
from daemon.system.safe_files import open_or_create

LOCK_BUSY_RETRY_S = 5.0  # a job whose trainer.lock is held by an earlier trainer waits this long between tries


class TrainerLockContention:
    def __init__(self, home: Path, store: Store, log):
        self.jobs_root = Path(home) / "jobs"
        self.store = store
        self.log = log
        self._holders_seen: dict[str, set[tuple[int, int] | None]] = {}  # job id → earlier trainers asked to stop

    def take(self, job_id: str, workdir: Path) -> int | None:
        """The open, locked trainer.lock of a job (the caller closes it), or None while another process holds it.

        Raises OSError when the job's directory cannot hold the lock at all (gone, unreadable, or trainer.lock is
        not a regular file of its own: a symlink planted there is never followed, locked or truncated).
        """
        fd = open_or_create(workdir / "trainer.lock", os.O_RDWR, LOCK_MODE)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            self._busy(job_id, workdir)
            return None
        except BaseException:
            os.close(fd)
            raise
        return fd

    def started(self, job_id: str) -> None:
        """The job's trainer runs: forget the holders seen before."""
        self._holders_seen.pop(job_id, None)

    def _busy(self, job_id: str, workdir: Path) -> None:
        self.store.update(job_id, not_before=time.time() + LOCK_BUSY_RETRY_S)
        seen = self._holders_seen.setdefault(job_id, set())
        holders = [t for t in proc.find_trainers(self.jobs_root) if t.workdir == workdir.resolve()]
        for t in holders:
            if (t.pid, t.start) not in seen:
                seen.add((t.pid, t.start))
                self.log.warning("trainer_still_running", job=job_id, pid=t.pid,
                                 message="an earlier trainer holds the job: asked it to stop (SIGTERM); waiting")
                proc.signal_group(t.pid, signal.SIGTERM)
        if not holders and None not in seen:
            seen.add(None)  # held by something we do not stop (`lorad run`, say): said once
            self.log.warning("trainer_lock_busy", job=job_id,
                             message="another process holds jobs/ID/trainer.lock; waiting for it")

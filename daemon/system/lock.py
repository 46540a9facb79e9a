"""Exclusive flocks that name their holder.

    HOME/lorad.lock          one daemon per home, held for the daemon's life
    jobs/ID/trainer.lock     one trainer per job: held by the daemon's trainer child (passed as an open
                             file) or by `lorad run` in the foreground

The kernel drops the lock when the process dies, however it dies, so a
SIGKILL or a power cut never leaves a stale lock behind. The holder writes
its pid into the file so that a refusal can say who holds it. A trainer.lock is in jobs/ID/, which the trainer
user may change: it is opened by descriptor, never through a symlink (daemon/system/safe_files.py), so locking
and truncating it never reach another file.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from daemon.system.safe_files import open_or_create

LOCK_MODE = 0o644  # the holder's pid, readable by whoever is refused


class AlreadyRunning(Exception):
    pass


class PidLock:
    def __init__(self, path: Path, busy: str):
        """busy: the refusal, with {pid} where the holder's pid goes."""
        self.path = Path(path)
        self.busy = busy
        self.fd: int | None = None

    def acquire(self) -> None:
        # Its directory is the home or a `lorad run` workdir, either of which may be reached through a symlink; the
        # daemon takes its trainers' jobs/ID/trainer.lock in daemon/supervisor/lock_contention.py.
        fd = open_or_create(self.path, os.O_RDWR, LOCK_MODE, follow_dir=True)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise AlreadyRunning(self.busy.format(pid=holder)) from None
        write_pid(fd, os.getpid())
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def write_pid(fd: int, pid: int) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{pid}\n".encode(), 0)


class HomeLock(PidLock):
    def __init__(self, home: Path):
        super().__init__(Path(home) / "lorad.lock", f"another lorad serve is already running on {home} (pid {{pid}})")


class TrainerLock(PidLock):
    def __init__(self, workdir: Path, name: str):
        super().__init__(Path(workdir) / "trainer.lock",
                         f"job {name} is already being trained in {workdir} (pid {{pid}}); "
                         f"wait for it, or stop it first")

"""Opening the files a job names while the job is checked: never blocking, never reading more than a budget.

Job validation runs in the daemon (the inbox, start-up recovery, `lorad submit`, the dashboard's form) on files
that any socket-group member names. Every check that reads such a file opens it here:

- its path resolved first (the allowed-roots check resolved it the same way), then opened with O_NOFOLLOW, so
  a link swapped in since is refused, not followed; stat first and fstat after must both show a regular file,
  and the open is O_NONBLOCK, so a FIFO, a socket or a device neither blocks the open nor is read;
- reads are capped (MAX_CHECK_READ: what one file may cost a check);
- a check has a time budget: the daemon sets a deadline for one job's check (a context variable: engine never
  imports daemon), every open and every step of a walk over a folder calls `tick`, and a spent budget is
  JobInvalid naming the key and the path.

A syscall that blocks anyway (a hung network filesystem) cannot be interrupted from Python: the daemon runs
the check in a worker thread and stops waiting for it at the same deadline (daemon/intake/checks.py), naming
where the budget last was (`Budget.where`). Outside a budget (`lorad run`, the trainer) only the opening rules
and the byte caps apply.
"""

from __future__ import annotations

import errno
import os
import stat
import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from engine.errors import JobInvalid

MAX_CHECK_READ = 16 << 20  # bytes one file may cost a check (a data file's first line, a model_index.json, ...)


class CheckTimedOut(JobInvalid):
    """A job's check ran past its time budget; the message names the key and the path it was at."""


@dataclass
class Budget:
    seconds: float
    deadline: float  # time.monotonic()
    where: str = ""  # "key: path" of the file or folder being checked now

    def spent_message(self) -> str:
        at = self.where or "the job's paths"
        return f"{at}: checking took longer than {self.seconds:g} s; refused (a slow, hung or special file?)"


_BUDGET: ContextVar[Budget | None] = ContextVar("lorad_check_budget", default=None)


@contextmanager
def budget(seconds: float) -> Iterator[Budget]:
    """A time budget for the checks run inside (in this thread or task)."""
    b = Budget(seconds, time.monotonic() + seconds)
    token = _BUDGET.set(b)
    try:
        yield b
    finally:
        _BUDGET.reset(token)


def tick(key: str | None, path: Path | str) -> None:
    """Say where the check is, and raise CheckTimedOut (naming it) once the budget is spent."""
    b = _BUDGET.get()
    if b is None:
        return
    b.where = f"{key}: {path}" if key else str(path)
    if time.monotonic() > b.deadline:
        raise CheckTimedOut(b.spent_message())


def open_regular(path: Path | str, key: str) -> BinaryIO:
    """`path` opened for reading, if it is a regular file: JobInvalid naming `key` otherwise (missing, a FIFO, a
    device, a socket, a link swapped in since it was resolved). The caller closes it."""
    tick(key, path)
    real = os.path.realpath(path)
    try:
        if not stat.S_ISREG(os.stat(real).st_mode):  # a device is never even opened
            raise JobInvalid(f"{key}: {path} is not a regular file")
        fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise JobInvalid(f"{key}: {path} does not exist") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise JobInvalid(f"{key}: {path} changed while being checked (now a symlink); not read") from None
        raise JobInvalid(f"{key}: cannot read {path}: {e.strerror}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # swapped between the stat and the open
            raise JobInvalid(f"{key}: {path} is not a regular file")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_capped(path: Path | str, key: str, most: int = MAX_CHECK_READ) -> bytes:
    """A small file a check reads whole (model_index.json): JobInvalid when it holds more than `most` bytes."""
    with open_regular(path, key) as f:
        data = f.read(most + 1)
    if len(data) > most:
        raise JobInvalid(f"{key}: {path} is larger than {most} bytes; not read")
    return data


def walk(folder: Path, pattern: str = "*", key: str | None = None) -> Iterator[Path]:
    """folder.rglob(pattern), each entry a step of the budget (a huge tree ends at the deadline, named)."""
    for p in Path(folder).rglob(pattern):
        tick(key, p)
        yield p

"""Reading a job file from incoming/ (claimed from the inbox) by descriptor: only a regular file, inside the
allowed roots, under the size cap, UTF-8 (daemon/system/safe_files.py).

What was opened is what is checked (its real path, its type, its size), so a symlink swapped between a check and
the open reads nothing else, a FIFO never blocks, and no device is opened.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from daemon.config.daemon import DaemonConfig
from daemon.system.safe_files import NotRegularFile, open_at, opened_dir, read_fd
from engine.config.reading import decode_job_bytes
from engine.errors import JobInvalid


def read_job_file(path: Path, display: str, cfg: DaemonConfig, home: Path) -> str:
    """The text of a job file: only a regular file, inside the allowed roots, under the size cap, UTF-8.

    By descriptor (daemon/system/safe_files.py): incoming/ is the daemon's, but what was claimed from the inbox
    may be a symlink; its target is checked before it is opened, and what was opened is checked again (its real
    path against the allowed roots, its type, its size), so a link swapped in between reads nothing else.
    """
    with opened_dir(path.parent) as d:
        try:
            fd = open_at(d, path.name, single_link=False)  # a file linked into the inbox (ln) is fine
        except NotRegularFile as e:
            if e.errno != errno.ELOOP:
                raise JobInvalid(f"{display}: not a regular file") from None
            fd = _open_link_target(d, path.name, display, cfg, home)
        except OSError as e:
            raise JobInvalid(f"{display}: cannot read: {e.strerror}") from None
    try:
        size = os.fstat(fd).st_size
        if size > cfg.max_job_file_bytes:
            raise JobInvalid(f"{display}: job file is {size} bytes, larger than the {cfg.max_job_file_bytes}-byte limit")
        data = read_fd(fd, cfg.max_job_file_bytes + 1)
    finally:
        os.close(fd)
    if len(data) > cfg.max_job_file_bytes:
        raise JobInvalid(f"{display}: job file grew past the {cfg.max_job_file_bytes}-byte limit while being read")
    return decode_job_bytes(data, display)


def _open_link_target(dir_fd: int, name: str, display: str, cfg: DaemonConfig, home: Path) -> int:
    """An inbox symlink's target: checked (inside the allowed roots, a regular file) before it is opened, so no
    device is ever opened; then opened without blocking, and what was opened is checked again (the link may
    have been swapped in between)."""
    policy = cfg.job_policy(home)
    link = Path(os.readlink(f"/proc/self/fd/{dir_fd}")) / name
    real = Path(os.path.realpath(link))
    if not policy.allows_path(real):
        raise JobInvalid(f"{display}: is a symlink to {real}, outside the allowed roots; not read")
    try:
        if not stat.S_ISREG(os.stat(real).st_mode):
            raise JobInvalid(f"{display}: not a regular file")
        fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as e:
        raise JobInvalid(f"{display}: cannot read: {e.strerror}") from None
    try:
        real = Path(os.readlink(f"/proc/self/fd/{fd}"))  # what was opened, not what the link says now
        if not policy.allows_path(real) or not stat.S_ISREG(os.fstat(fd).st_mode):
            raise JobInvalid(f"{display}: changed while being read (now {real}); not read")
    except BaseException:
        os.close(fd)
        raise
    return fd

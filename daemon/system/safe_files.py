"""Files the daemon opens in directories that someone else can write: inbox/, incoming/, rejected/ and jobs/ID/
(handed to the trainer user, who may replace anything in it).

Every open here is relative to a descriptor of the directory and never follows a symlink in the last component
(O_NOFOLLOW); it never blocks (O_NONBLOCK: a FIFO or a device answers at once) and only a regular file with one
link is used (fstat, on what was opened, not on the name). A new file is made with O_EXCL, so nothing planted at
its name is followed or reused; a durable write goes to an unpredictable temp name (secrets.token_hex) and is
renamed over the final name through the same directory descriptor, with the file and the directory fsynced.
Modes are set with fchmod on the open file, whatever the daemon's umask.

Why hand-written: Python's open() and pathlib follow symlinks and block on a FIFO, tempfile makes its names
unpredictable but opens by path and neither fsyncs nor renames, and no library offers directory-relative,
no-follow, non-blocking opens with a durable write. engine/storage/fsio.py writes the engine's own directories
by path and stays as it is (the crash-state tests record its operations).
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

_AT = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class NotRegularFile(OSError):
    """The name is a symlink, a FIFO, a device, a directory or a file with several links: not opened, not used."""

    def __str__(self) -> str:
        return self.strerror  # it names the file


@contextmanager
def opened_dir(path: Path, follow: bool = False) -> Iterator[int]:
    """A descriptor of the directory `path`, closed on leaving. Never a symlink itself unless `follow` (a directory
    no one else can swap: the home, a `lorad run` workdir of one's own, which may be reached through a link)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW))
    try:
        yield fd
    finally:
        os.close(fd)


@contextmanager
def opened_dir_at(dir_fd: int, name: str) -> Iterator[int]:
    """A descriptor of the directory `name` in `dir_fd`, never through a symlink, closed on leaving."""
    fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        yield fd
    finally:
        os.close(fd)


def open_at(dir_fd: int, name: str, flags: int = os.O_RDONLY, mode: int = 0o600, single_link: bool = True) -> int:
    """Open `name` in the directory `dir_fd`: never through a symlink, never blocking, a regular file only.

    single_link: refuse a file with several hard links (a link to someone else's file made in a directory one
    may write). Raises NotRegularFile (an OSError) for anything else, and the OSError of open itself.
    """
    try:
        fd = os.open(name, flags | _AT, mode, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise NotRegularFile(errno.ELOOP, f"{name} is a symlink (not followed)", name) from None
        if e.errno in (errno.ENXIO, errno.EISDIR, errno.ENODEV):  # a FIFO without a reader, a directory, a device
            raise NotRegularFile(e.errno, f"{name} is not a regular file", name) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegularFile(errno.EINVAL, f"{name} is not a regular file", name)
        if single_link and st.st_nlink != 1:
            raise NotRegularFile(errno.EMLINK, f"{name} has {st.st_nlink} hard links (not used)", name)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_file(path: Path, flags: int = os.O_RDONLY, single_link: bool = True) -> int:
    """open_at for a path: its directory opened first (by path: a directory the daemon owns), then the name in it."""
    path = Path(path)
    with opened_dir(path.parent) as d:
        return open_at(d, path.name, flags, single_link=single_link)


def open_or_create(path: Path, flags: int, mode: int, follow_dir: bool = False) -> int:
    """Open `path` with `flags` (O_WRONLY | O_APPEND, O_RDWR), creating it with `mode` if it is not there.

    A new file is made with O_EXCL and given `mode` by fchmod; an existing one must be a regular file with one link.
    follow_dir: its directory may be reached through a symlink (opened_dir's `follow`).
    """
    path = Path(path)
    with opened_dir(path.parent, follow=follow_dir) as d:
        for _ in range(3):  # created and removed by someone else in between: try again, a few times
            try:
                fd = open_at(d, path.name, flags | os.O_CREAT | os.O_EXCL, mode)
            except FileExistsError:
                pass
            else:
                _fchmod_or_close(fd, mode)
                return fd
            try:
                return open_at(d, path.name, flags)
            except FileNotFoundError:
                continue
    raise FileNotFoundError(errno.ENOENT, "kept disappearing while being opened", str(path))


def append(path: Path, data: bytes, mode: int = 0o640) -> None:
    """Append `data` to `path` in one write (O_APPEND), creating it with `mode`."""
    fd = open_or_create(path, os.O_WRONLY | os.O_APPEND, mode)
    try:
        _write_all(fd, data)
    finally:
        os.close(fd)


def read_bytes(path: Path, limit: int, single_link: bool = True) -> bytes:
    """At most `limit` + 1 bytes of the regular file `path` (one more than the limit tells the caller it is over)."""
    fd = open_file(path, single_link=single_link)
    try:
        return read_fd(fd, limit + 1)
    finally:
        os.close(fd)


def read_fd(fd: int, limit: int) -> bytes:
    chunks, n = [], 0
    while n < limit:
        chunk = os.read(fd, min(65536, limit - n))
        if not chunk:
            break
        chunks.append(chunk)
        n += len(chunk)
    return b"".join(chunks)


def write_durable(path: Path, data: bytes, mode: int) -> None:
    """Replace `path` with `data` atomically and durably: an O_EXCL temp file of unpredictable name, given `mode`,
    written and fsynced, renamed over `path` in the same directory descriptor, and the directory fsynced.

    A symlink at the final name is replaced, never followed. On failure the temp file is removed.
    """
    path = Path(path)
    with opened_dir(path.parent) as d:
        tmp = f".{path.name}.tmp-{secrets.token_hex(8)}"
        fd = open_at(d, tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            try:
                os.fchmod(fd, mode)
                _write_all(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, path.name, src_dir_fd=d, dst_dir_fd=d)
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=d)
            except OSError:
                pass
            raise
        os.fsync(d)


def fchmod_at(dir_fd: int, name: str, mode: int) -> bool:
    """Set the mode of the regular file `name` through a descriptor of it (never a symlink's target). False when
    there is no such file or it is not a regular file (left alone)."""
    try:
        fd = open_at(dir_fd, name)
    except (FileNotFoundError, NotRegularFile):
        return False
    try:
        os.fchmod(fd, mode)
    finally:
        os.close(fd)
    return True


def _fchmod_or_close(fd: int, mode: int) -> None:
    try:
        os.fchmod(fd, mode)
    except BaseException:
        os.close(fd)
        raise


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
